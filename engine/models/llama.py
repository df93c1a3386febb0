"""The decoder of the Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm), of
its mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE: the same attention, an MoE MLP in the
layers their config makes sparse), of DeepSeek-V2 and V3 (multi-head latent attention,
`pdserve.engine.models.mla`, and DeepSeek's experts), of gpt-oss (attention sinks, its own
experts in `pdserve.engine.models.gpt_oss`) and of Llama 4's text model (NoPE and chunked
layers, its q/k treatment and experts in `pdserve.engine.models.llama4`), running attention over
the paged KV pool and the experts through the kernel op table."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.kv.groups import groups_for
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.gpt_oss import GptOssMoE
from pdserve.engine.models.llama4 import Llama4MoE, Llama4QK
from pdserve.engine.models.mla import LatentAttention
from pdserve.engine.models.moe import SparseMoE
from pdserve.engine.models.norm import RMSNorm
from pdserve.engine.models.projection import projection
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.quant.experts import QuantExperts
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.parallel_layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.op_table import Ops

# An expert's projection, by its checkpoint name (Mixtral's block_sparse_moe read as mlp).
EXPERT_WEIGHT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv)")
# A layer's weight read by the module it belongs to, where that module has a `load` (MLA's
# attention, gpt-oss's experts): the layer, the module, the name within it.
MODULE_WEIGHT = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(.+)")
EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",  # Mixtral
    "w3": "up",
    "w2": "down",
}


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        # Its KV group's slots and tables, and what its queries read (a window, a chunk).
        groups = groups_for(cfg.num_layers, cfg.layer_kinds)
        self.kv_group = groups.group_of[layer_index]
        self.mask = groups.groups[self.kv_group].kind.kernel_args()
        self.num_heads = len(shard.q_heads(cfg.num_heads))
        self.num_kv_heads = len(shard.kv_heads(cfg.num_kv_heads))
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k and v of this rank's heads in one matmul (column-parallel); loading concatenates
        # the checkpoint's three projections.
        prefix = f"model.layers.{layer_index}.self_attn."
        self.qkv_proj = projection(
            cfg,
            [prefix + p for p in ("q_proj", "k_proj", "v_proj")],
            cfg.hidden_size,
            (self.q_size, self.kv_size, self.kv_size),
            cfg.attention_bias,
        )
        self.o_proj = projection(
            cfg,
            [prefix + "o_proj"],
            self.q_size,
            (cfg.hidden_size,),
            cfg.o_proj_bias,
            group,
            row_parallel=True,
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Llama 4: rotary (interleaved) on some layers only, their L2 norm, the others' temperature.
        self.llama4 = Llama4QK(cfg.llama4, layer_index, cfg.rms_norm_eps) if cfg.llama4 else None
        # gpt-oss: a learned logit per query head (this rank's) in the softmax's denominator.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None

    def project(
        self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens' queries, keys and values, [tokens, heads, head_dim], q and k normed (where
        the family has it) and rotated: what attention reads, whatever it attends over (the
        paged pool here; a whole causal sequence in training)."""
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        if self.llama4 is not None:
            q, k = self.llama4(q, k, positions, cos_sin)
        else:
            q, k = ops.apply_rotary(q, k, positions, cos_sin)
        return q, k, v

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        q, k, v = self.project(hidden, positions, cos_sin, ops)
        out = self.paged(q, k, v, batch, pool, ops)
        return self.o_proj(out.reshape(-1, self.q_size))

    def paged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        ops: Ops,
    ) -> torch.Tensor:
        """The tokens' K and V stored in this layer's pages, then their queries' attention over
        the pages of their KV group: [tokens, heads, head_dim]."""
        k_cache, v_cache = pool.layer(self.layer_index)
        slot_mapping, block_tables = batch.group(self.kv_group)
        ops.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return ops.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            self.scale,
            batch.max_query_len,
            **self.mask,
            sinks=self.sinks,
        )


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        shard: TPShard,
        group: TPGroup | None,
        width: int | None = None,
        prefix: str | None = None,
    ) -> None:
        """width: this rank's columns (by default its share of the config's intermediate_size);
        without a group the down projection's output is this rank's partial sum. prefix: the
        checkpoint's name of this MLP (`model.layers.3.mlp.`), where its projections may be
        quantized."""
        super().__init__()
        self.intermediate_size = width = width or len(shard.columns(cfg.intermediate_size))
        if prefix is None:  # an expert's or another family's MLP: never quantized
            cfg = _unquantized(cfg)
        prefix = prefix or ""
        names = [prefix + "gate_proj", prefix + "up_proj"]
        self.gate_up_proj = projection(cfg, names, cfg.hidden_size, (width, width), False)
        self.down_proj = projection(
            cfg, [prefix + "down_proj"], width, (cfg.hidden_size,), False, group, True
        )

    def forward(self, x: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        super().__init__()
        attention = LatentAttention if cfg.is_mla else Attention
        self.self_attn = attention(cfg, layer_index, shard, group)
        if cfg.is_sparse_layer(layer_index) and cfg.clamped_swiglu is not None:
            self.mlp = GptOssMoE(cfg, shard, group, layer_index)
        elif cfg.is_sparse_layer(layer_index) and cfg.llama4 is not None:
            self.mlp = Llama4MoE(cfg, shard, group, MLP)
        elif cfg.is_sparse_layer(layer_index):
            moe = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"  # checkpoint names
            self.mlp = SparseMoE(cfg, shard, group, MLP, f"model.layers.{layer_index}.{moe}.")
        else:
            self.mlp = MLP(cfg, shard, group, prefix=f"model.layers.{layer_index}.mlp.")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attend(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention on the norm of the residual stream plus the previous layer's output:
        (attention's output, the stream). The first layer's residual is None: hidden is the
        stream."""
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            normed = ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            normed, residual = ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mix(normed, positions, batch, pool, cos_sin, ops), residual

    def mix(
        self,
        normed: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        """The layer's token mixer on the normed stream: its attention (a family whose layers
        mix tokens otherwise names its own)."""
        return self.self_attn(normed, positions, batch, pool, cos_sin, ops)

    def feed_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP on the norm of the residual stream plus attention's output: (the MLP's
        output, the stream)."""
        norm = self.post_attention_layernorm
        normed, residual = ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(normed, ops), residual


class LlamaForCausalLM(nn.Module):
    """Checkpoint names follow Hugging Face's, except the fused qkv_proj and gate_up_proj.

    With a tensor-parallel `shard` (and its `group`), the module holds that rank's part: its
    query and KV heads, its MLP columns, its rows of the vocabulary."""

    # A family whose layers differ in what surrounds attention and the MLP (Gemma's norms) names
    # its own layer class; the step loop in `forward` is every family's.
    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(
        self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None
    ) -> None:
        super().__init__()
        shard = shard or TPShard()
        self.config = cfg
        self.shard = shard
        vocab_rows = shard.vocab_rows(cfg.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, group)
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, i, shard, group) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(vocab_rows, cfg.hidden_size, cfg.vocab_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", self._rotary_table(cfg), persistent=False)

    @property
    def eager_only(self) -> str | None:
        """Why a step of this model cannot be captured in a CUDA graph or compiled (one line),
        or None when it can."""
        if self.config.clamped_swiglu is not None:
            return "gpt-oss's experts run in torch, grouping their tokens on the host"
        for layer in self.layers:  # quantized experts say whether their step can be captured
            experts = getattr(layer.mlp, "experts", None)
            if isinstance(experts, QuantExperts) and experts.eager_only is not None:
                return experts.eager_only
        return None

    @staticmethod
    def _rotary_table(cfg: ModelConfig) -> torch.Tensor:
        inv_freq = cfg.inv_freq().float()
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        factor = cfg.rotary_attention_factor()  # YaRN's; 1.0 for every other rotary type
        return table if factor == 1.0 else table * factor

    def make_tables(self, device: str | torch.device) -> None:
        """Compute the model's constant tables on `device` once its parameters are there in
        their dtype: a model built on the meta device holds none."""
        self.cos_sin = self._rotary_table(self.config).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        ops: Ops,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden_size]. on_layer(i) runs once
        layer i's attention has written its K/V into the pool (on a GPU: once its kernels are
        queued on the current stream), e.g. to send those pages while later layers compute."""
        hidden = self.embed(input_ids)
        residual = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer.attend(
                hidden, residual, positions, batch, pool, self.cos_sin, ops
            )
            if on_layer is not None:
                on_layer(index)
            hidden, residual = layer.feed_forward(hidden, residual, ops)
        normed, _ = ops.fused_add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)
        return normed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, the residual stream's start."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [n, vocab]; None on a tensor-parallel rank other than 0."""
        return self.lm_head(hidden)

    # --- loading -------------------------------------------------------------------------------

    def _slices(self, mlp_width: int) -> dict[str, tuple[str, int, range, int, int]]:
        """Per split checkpoint weight (by the name's part before `weight` / `bias`): our
        parameter's name part, the split dimension (0: rows, 1: columns), the range of it this
        rank reads, the whole dimension's size, and where the rows go in our fused parameter.
        mlp_width: the whole intermediate size of the MLP the name belongs to."""
        cfg, shard = self.config, self.shard
        hd = cfg.head_dim
        q = shard.q_heads(cfg.num_heads)
        kv = shard.kv_heads(cfg.num_kv_heads)
        q_rows = range(q.start * hd, q.stop * hd)
        kv_rows = range(kv.start * hd, kv.stop * hd)
        q_all, kv_all = cfg.num_heads * hd, cfg.num_kv_heads * hd
        mlp = shard.columns(mlp_width)
        inter = mlp_width
        vocab = shard.vocab_rows(cfg.vocab_size)
        return {
            "q_proj": ("qkv_proj", 0, q_rows, q_all, 0),
            "k_proj": ("qkv_proj", 0, kv_rows, kv_all, len(q_rows)),
            "v_proj": ("qkv_proj", 0, kv_rows, kv_all, len(q_rows) + len(kv_rows)),
            "o_proj": ("o_proj", 1, q_rows, q_all, 0),
            "gate_proj": ("gate_up_proj", 0, mlp, inter, 0),
            "up_proj": ("gate_up_proj", 0, mlp, inter, len(mlp)),
            "down_proj": ("down_proj", 1, mlp, inter, 0),
            "embed_tokens": ("embed_tokens", 0, vocab, cfg.vocab_size, 0),
            "lm_head": ("lm_head", 0, vocab, cfg.vocab_size, 0),
        }

    def load_weights(self, weights: Iterable[CheckpointTensor]) -> None:
        """Read this rank's part of each checkpoint tensor into place (only that part is read
        from the file); raise naming the first missing, unexpected or misshapen weight."""
        cfg = self.config
        params = dict(self.named_parameters())
        dense_slices = self._slices(cfg.intermediate_size)
        shared_slices = self._slices(cfg.shared_expert_intermediate_size)
        prefix = cfg.weights_prefix
        expected = {prefix + name for name in self._checkpoint_names()}
        seen: set[str] = set()
        for tensor in weights:
            name = tensor.name
            if not name.startswith(prefix):
                continue  # a multimodal checkpoint's vision tower and projector
            local = name[len(prefix) :]
            local = local[len("model.") :] if local.startswith("model.") else local
            if local == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if "rotary_emb" in local:
                continue
            if _extra_layer(local, cfg.num_layers):
                continue  # DeepSeek-V3's multi-token-prediction layers: not loaded
            if name not in expected:
                raise ValueError(f"unexpected weight '{name}' in checkpoint")
            local = local.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for it
            local = local.replace(".shared_experts.", ".shared_expert.")  # DeepSeek's
            local = local.replace(".feed_forward.", ".mlp.")  # Llama 4's
            loading = self._loading_module(local)
            if loading is not None:
                module, weight = loading
                module.load(weight, tensor)
                seen.add(name)
                continue
            if local.endswith(".self_attn.sinks"):
                self._load_sinks(tensor, int(local.split(".")[1]))
                seen.add(name)
                continue
            if local.endswith(".mlp.gate.e_score_correction_bias"):
                self._load_correction_bias(tensor, int(local.split(".")[1]))
                seen.add(name)
                continue
            expert = EXPERT_WEIGHT.fullmatch(local)
            if expert is not None:
                self._load_expert(tensor, *expert.groups())
                seen.add(name)
                continue
            parts = local.split(".")
            slices = shared_slices if "shared_expert" in parts else dense_slices
            split = slices.get(parts[-2]) if len(parts) >= 2 else None
            if split is not None and split[1] == 1 and parts[-1] == "bias":
                split = None  # a row-parallel layer's bias is whole on every rank
            if split is not None and parts[-1] != "bias":
                module = self.get_submodule(".".join(parts[:-2] + [split[0]]))
                if isinstance(module, QuantLinear) and parts[-1] in module.kinds:
                    dest, dim, part, size, offset = split
                    offset = 0 if dim == 0 and dest == parts[-2] else offset
                    module.load(parts[-1], tensor, dim, part, size, offset)
                    seen.add(name)
                    continue
            if split is None:
                param, want, part, offset = params[local], None, None, 0
                full = tuple(param.shape)
            else:
                dest, dim, part, size, offset = split
                param = params[".".join(parts[:-2] + [dest, parts[-1]])]
                full = list(param.shape)
                full[dim] = size
                full = tuple(full)
                if dim == 0 and dest == parts[-2]:
                    offset = 0  # an unfused parameter holds exactly its rows
                want = dim
            if tuple(tensor.shape) != full:
                raise ValueError(
                    f"weight '{name}' has shape {tuple(tensor.shape)}, expected {full}"
                )
            with torch.no_grad():
                if want is None:
                    param.data.copy_(tensor.read())
                elif want == 0:
                    param.data.narrow(0, offset, len(part)).copy_(tensor.read(rows=part))
                else:
                    param.data.copy_(tensor.read(columns=part))
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(
                f"missing weight '{missing[0]}' in checkpoint ({len(missing)} missing)"
            )
        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.loaded()

    def _loading_module(self, local: str) -> tuple[nn.Module, str] | None:
        """The module that reads this weight itself (MLA's attention, gpt-oss's experts) and the
        weight's name within it; None where `load_weights` reads it itself."""
        match = MODULE_WEIGHT.fullmatch(local)
        if match is None:
            return None
        layer, module, part = match.groups()
        owner = getattr(self.layers[int(layer)], module)
        return (owner, part) if hasattr(owner, "load") else None

    def _load_sinks(self, tensor: CheckpointTensor, layer: int) -> None:
        """gpt-oss's sinks, one per query head: this rank's heads'."""
        num_heads = self.config.num_heads
        if tuple(tensor.shape) != (num_heads,):
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {(num_heads,)}"
            )
        with torch.no_grad():
            sinks = self.layers[layer].self_attn.sinks
            sinks.data.copy_(tensor.read(rows=self.shard.q_heads(num_heads)))

    def _load_expert(
        self, tensor: CheckpointTensor, layer: str, expert: str, proj: str, kind: str
    ) -> None:
        """Read this rank's columns of one expert's projection into the stacked weights (a
        quantized stack reads its own tensors, `kind` among them)."""
        cfg = self.config
        experts = self.layers[int(layer)].mlp.experts
        cols = self.shard.columns(cfg.moe_intermediate_size)
        role = EXPERT_PROJECTIONS[proj]
        if isinstance(experts, QuantExperts):
            experts.load(kind, tensor, int(expert), role, cols, cfg.moe_intermediate_size)
            return
        if role == "down":
            full = (cfg.hidden_size, cfg.moe_intermediate_size)
        else:
            full = (cfg.moe_intermediate_size, cfg.hidden_size)
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full}"
            )
        with torch.no_grad():
            if role == "down":
                experts.w2.data[int(expert)].copy_(tensor.read(columns=cols))
            else:
                offset = 0 if role == "gate" else len(cols)
                rows = experts.w13.data[int(expert)].narrow(0, offset, len(cols))
                rows.copy_(tensor.read(rows=cols))

    def _load_correction_bias(self, tensor: CheckpointTensor, layer: int) -> None:
        """V3's e_score_correction_bias, read in float32 whatever the model's dtype: a
        bfloat16 copy would route some tokens to other experts."""
        moe = self.layers[layer].mlp
        if tuple(tensor.shape) != (self.config.num_experts,):
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, "
                f"expected {(self.config.num_experts,)}"
            )
        moe.e_score_correction_bias = tensor.read(dtype=torch.float32).to(moe.gate.weight.device)

    def float32_router_biases(self) -> None:
        """Put the routers' correction biases back in float32 after a cast of the model."""
        for layer in self.layers:
            bias = getattr(layer.mlp, "e_score_correction_bias", None)
            if bias is not None:
                layer.mlp.e_score_correction_bias = bias.float()

    def _checkpoint_names(self) -> list[str]:
        """Every weight the checkpoint must hold: a quantized projection's tensors (its scheme's
        `tensor_names`) in place of its `weight`."""
        names = self._plain_checkpoint_names()
        scheme = self.config.quantization
        if scheme is None:
            return names
        held = []
        for name in names:
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and scheme.quantizes(module):
                held += [f"{module}.{kind}" for kind in scheme.tensor_names]
            else:
                held.append(name)
        return held

    def _plain_checkpoint_names(self) -> list[str]:
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            mlp = self.layers[i].mlp
            if hasattr(mlp, "checkpoint_names"):
                names += mlp.checkpoint_names(p)
            elif cfg.is_sparse_layer(i):
                names += self._sparse_mlp_names(p)
            else:
                ffn = "feed_forward" if cfg.llama4 else "mlp"  # Llama 4's name for it
                names += [p + f"{ffn}.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
            if cfg.is_mla:
                names += self.layers[i].self_attn.checkpoint_names(p)
                continue
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.append(p + f"self_attn.{proj}.weight")
                if cfg.attention_bias:
                    names.append(p + f"self_attn.{proj}.bias")
            names.append(p + "self_attn.o_proj.weight")
            if cfg.o_proj_bias:
                names.append(p + "self_attn.o_proj.bias")
            if cfg.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            if cfg.attention_sinks:
                names.append(p + "self_attn.sinks")
        return names

    def _sparse_mlp_names(self, prefix: str) -> list[str]:
        """A sparse layer's weights as the family's checkpoints name them."""
        cfg = self.config
        if cfg.model_type == "mixtral":
            moe, projections = prefix + "block_sparse_moe.", ("w1", "w2", "w3")
        else:
            moe, projections = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
        names = [moe + "gate.weight"]
        if cfg.score_correction_bias:
            names.append(moe + "gate.e_score_correction_bias")
        for e in range(cfg.num_experts):
            names += [moe + f"experts.{e}.{proj}.weight" for proj in projections]
        if cfg.shared_expert_intermediate_size:
            shared = "shared_expert" if cfg.shared_expert_gated else "shared_experts"
            names += [
                moe + f"{shared}.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")
            ]
            if cfg.shared_expert_gated:
                names.append(moe + "shared_expert_gate.weight")
        return names


def _unquantized(cfg: ModelConfig) -> ModelConfig:
    return cfg if cfg.quantization is None else dataclasses.replace(cfg, quantization=None)


def _extra_layer(local: str, num_layers: int) -> bool:
    """A weight of a layer past the decoder's own (`layers.N.` with N >= num_layers)."""
    if not local.startswith("layers."):
        return False
    index = local.split(".", 2)[1]
    return index.isdigit() and int(index) >= num_layers
