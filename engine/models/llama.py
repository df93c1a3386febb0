"""The decoder of the Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm),
running attention over the paged KV pool through the kernel op table."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import AttentionBatch
from engine.kv_cache import KVPool
from engine.model_config import ModelConfig
from kernels.ops import Ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k and v in one matmul; loading concatenates the checkpoint's three projections.
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.apply_rotary(q, k, positions, cos_sin)
        k_cache, v_cache = pool.layer(self.layer_index)
        ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            self.scale,
            batch.max_query_len,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_index)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Checkpoint names follow Hugging Face's, except the fused qkv_proj and gate_up_proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", self._rotary_table(cfg), persistent=False)

    @staticmethod
    def _rotary_table(cfg: ModelConfig) -> torch.Tensor:
        inv_freq = cfg.inv_freq().float()
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        ops: Ops,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            if residual is None:
                residual = hidden
                normed = ops.rms_norm(
                    hidden, layer.input_layernorm.weight, layer.input_layernorm.eps
                )
            else:
                normed, residual = ops.fused_add_rms_norm(
                    hidden, residual, layer.input_layernorm.weight, layer.input_layernorm.eps
                )
            hidden = layer.self_attn(normed, positions, batch, pool, self.cos_sin, ops)
            normed, residual = ops.fused_add_rms_norm(
                hidden,
                residual,
                layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.eps,
            )
            hidden = layer.mlp(normed)
        normed, _ = ops.fused_add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # --- loading -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; raise naming the first missing or unexpected weight."""
        cfg = self.config
        params = dict(self.named_parameters())
        # Fused destinations: (our param, slice start, slice length) per checkpoint name part.
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        expected = set(self._checkpoint_names())
        seen: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                local = name[len("model.") :]
            else:
                local = name
            if local == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if "rotary_emb" in local:
                continue
            if name not in expected:
                raise ValueError(f"unexpected weight '{name}' in checkpoint")
            parts = local.split(".")
            target = local
            rows = None
            if len(parts) >= 2 and parts[-2] in fused:
                dest, start, length = fused[parts[-2]]
                target = ".".join(parts[:-2] + [dest, parts[-1]])
                rows = (start, length)
            param = params[target]
            with torch.no_grad():
                dst = param.data if rows is None else param.data.narrow(0, *rows)
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight '{name}' has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(
                f"missing weight '{missing[0]}' in checkpoint ({len(missing)} missing)"
            )

    def _checkpoint_names(self) -> list[str]:
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.append(p + f"self_attn.{proj}.weight")
                if cfg.attention_bias:
                    names.append(p + f"self_attn.{proj}.bias")
            names.append(p + "self_attn.o_proj.weight")
            if cfg.o_proj_bias:
                names.append(p + "self_attn.o_proj.bias")
            if cfg.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            names += [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        return names
