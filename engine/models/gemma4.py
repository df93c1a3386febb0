"""Gemma 4's text decoder, from a `Gemma4ForCausalLM` checkpoint or the language model of a
multimodal `Gemma4ForConditionalGeneration` one, over the paged KV pool.

What it adds to Gemma 3's layer (sandwich norms, a GeGLU MLP, a scaled embedding, a tanh cap on
the logits), as transformers 5.24 computes it:

- Attention of two shapes: the full layers' heads are wider (`global_head_dim`, 512 in the
  releases) and may be fewer (`num_global_key_value_heads`); their rotary is "proportional"
  (only the first `partial_rotary_factor` of each head's frequencies turn, over the whole head's
  width), the sliding layers' the default one. q, k and v are RMS-normalised per head (v without
  a weight), the softmax is scaled by 1, and with `attention_k_eq_v` the full layers' values are
  their keys' projection (normalised apart, not rotated). The pool holds both shapes in lanes
  (`pdserve.engine.kv.groups`).
- KV sharing: the last `num_kv_shared_layers` layers compute no keys or values; each attends
  over the pages of the last earlier layer of its type, and owns none (`ModelConfig.kv_donors`).
- Per-layer embeddings (PLE): a second embedding of `hidden_size_per_layer_input` per layer, mixed
  with a projection of the embedded token, gates a small residual branch after each layer's MLP.
- A mixture of experts beside the MLP (`enable_moe_block`): a router reading the layer's input,
  the experts' GeGLU on its own norm, the two outputs normalised apart and added.
- Each layer's output scaled by its `layer_scalar`; the MLP twice as wide on KV-sharing layers
  with `use_double_wide_mlp`.

Norm weights multiply as they are (x * weight, not Gemma 3's 1 + weight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.engine.cpu.linear import Linear, linear
from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool, model_groups
from pdserve.engine.kv.groups import KVGroups
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.gemma3 import GELU_APPROXIMATION, GeGLU
from pdserve.engine.models.llama import MLP, LlamaForCausalLM
from pdserve.engine.models.moe import Experts
from pdserve.engine.models.norm import RMSNorm
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.parallel_layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels import rotary_ref
from pdserve.kernels.moe_ref import grouped_experts
from pdserve.kernels.op_table import Ops

# A multimodal checkpoint's language model by the prefix of its names; its vision and audio
# towers and their embedders are not loaded.
TEXT_PREFIX = "model.language_model."
OTHER_TOWERS = (
    "model.vision_tower.",
    "model.embed_vision.",
    "model.audio_tower.",
    "model.embed_audio.",
)
# What a KV-sharing layer's checkpoint may still hold of the projections it does not use.
UNUSED_BY_SHARING = ("k_proj", "v_proj", "k_norm", "v_norm")


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's value norm and its router's input), in float32."""
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def rotary_inv_freq(rope: dict, theta: float, head_dim: int) -> torch.Tensor:
    """A layer type's rotary frequencies over its head_dim: the default ones, or "proportional"
    (the first partial_rotary_factor of them turning, the rest zero, so those dimensions keep
    their values; all divided by `factor`), as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta**exponents)
    if rope.get("rope_type", "default") == "proportional":
        turning = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv[turning:] = 0.0
        inv = inv / float(rope.get("factor", 1.0))
    return inv


def rotary_table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[positions, head_dim]: cos | sin halves, as the op table's rotary reads them."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class Gemma4Attention(nn.Module):
    """One layer's attention: its own heads' shape, its q/k/v norms, and either its own KV
    (written into its pages) or, on a KV-sharing layer, its donor's pages read as they are."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_index: int,
        groups: KVGroups,
        shard: TPShard,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.donor = cfg.kv_donors[layer_index] if cfg.kv_donors else layer_index
        self.owns_kv = self.donor == layer_index
        # Its donor's KV group (its own for a layer keeping KV): a kind of the same reach.
        self.kv_group = groups.group_of[self.donor]
        self.mask = groups.groups[self.kv_group].kind.kernel_args()
        self.head_dim = head_dim = cfg.head_dim_of(layer_index)
        self.num_heads = len(shard.q_heads(cfg.num_heads))
        self.num_kv_heads = len(shard.kv_heads(cfg.kv_heads_of(layer_index)))
        self.k_eq_v = cfg.gemma4.k_eq_v_layers[layer_index]
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim if self.owns_kv else 0
        projected = self.q_size + self.kv_size * (1 if self.k_eq_v else 2)
        self.qkv_proj = Linear(cfg.hidden_size, projected, bias=False)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, False, group)
        self.eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if self.owns_kv else None

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
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        q = ops.rms_norm(q, self.q_norm.weight, self.eps)
        pages = pool.layer_pages(self.donor)
        k_cache, v_cache = pages.planes
        slot_mapping, block_tables = batch.group(self.kv_group)
        if self.owns_kv:
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size :]
            k = k.reshape(-1, self.num_kv_heads, self.head_dim)
            v = rms(v.reshape(-1, self.num_kv_heads, self.head_dim), self.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.eps)
            q, k = ops.apply_rotary(q, k, positions, cos_sin)
            ops.store_kv(k, v, k_cache, v_cache, pages.slots(slot_mapping))
        else:  # the donor, an earlier layer of this step, has written this step's KV
            q, _ = rotary_ref.apply_rotary(q, q[:, :0], positions, cos_sin)
        out = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            pages.tables(block_tables),
            batch.seq_lens,
            batch.query_start_loc,
            1.0,  # Gemma 4 scales q and k by their norms alone
            batch.max_query_len,
            **self.mask,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class Gemma4MLP(GeGLU):
    """The GeGLU MLP of a given width (a rank's columns of it)."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup | None, width: int) -> None:
        MLP.__init__(self, cfg, shard, group, len(shard.columns(width)))
        self.approximate = GELU_APPROXIMATION[cfg.mlp_activation]


class GeluExperts(Experts):
    """Experts whose gated MLP is GeGLU (Gemma 4's), stacked or packed for oneDNN."""

    approximate = "tanh"

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.packed_experts is not None:
            packed13, packed2 = self.packed_experts[e]
            gate, up = linear(x, None, None, packed13).split(self.width, dim=-1)
            return linear(F.gelu(gate, approximate=self.approximate) * up, None, None, packed2)
        gate, up = F.linear(x, self.w13[e]).split(self.width, dim=-1)
        return F.linear(F.gelu(gate, approximate=self.approximate) * up, self.w2[e])


class Gemma4MoE(nn.Module):
    """The experts beside a layer's MLP. The router reads the layer's input (the residual
    stream before the MLP), RMS-normalised, scaled by its `scale` and 1/sqrt(hidden), softmaxes
    its logits in float32, keeps each token's k largest, renormalises them and multiplies each
    by its expert's `per_expert_scale`; the experts read that input through their own norm and
    their summed output is normalised before it joins the MLP's. Tensor parallelism splits every
    expert's columns; the router is whole on every rank; the output is all-reduced before its
    norm (which needs the whole sum)."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup | None) -> None:
        super().__init__()
        self.group = group
        self.top_k = cfg.num_experts_per_tok
        self.eps = cfg.rms_norm_eps
        self.input_scale = cfg.hidden_size**-0.5
        self.columns = shard.columns(cfg.moe_intermediate_size)
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.router_scale = nn.Parameter(torch.empty(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(cfg.num_experts))
        self.experts = GeluExperts(cfg.num_experts, len(self.columns), cfg.hidden_size)
        self.experts.approximate = GELU_APPROXIMATION[cfg.mlp_activation]
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k experts and their weights [T, k] (float32)."""
        scores = self.router(rms(x, self.eps) * self.router_scale * self.input_scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        weights, ids = self.route(x)
        experts = self.experts
        normed = ops.rms_norm(x, self.pre_norm.weight, self.eps)
        out = grouped_experts(
            normed, weights, ids, experts.num_experts, experts.hidden_size, experts.expert
        )
        if self.group is not None:
            out = self.group.all_reduce(out)
        return ops.rms_norm(out, self.post_norm.weight, self.eps)


class PerLayerInput(nn.Module):
    """A layer's per-layer-embedding branch: gelu(gate(h)) times the layer's PLE vector,
    projected back to the hidden size and normalised (whole on every tensor-parallel rank)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.gemma4.per_layer_input_size
        self.approximate = GELU_APPROXIMATION[cfg.mlp_activation]
        self.gate = Linear(cfg.hidden_size, width, bias=False)
        self.projection = Linear(width, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, per_layer: torch.Tensor, ops: Ops) -> torch.Tensor:
        branch = F.gelu(self.gate(hidden), approximate=self.approximate) * per_layer
        return ops.rms_norm(self.projection(branch), self.norm.weight, self.norm.eps)


class Gemma4DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_index: int,
        groups: KVGroups,
        shard: TPShard,
        group: TPGroup | None,
    ) -> None:
        super().__init__()
        g4 = cfg.gemma4
        self.self_attn = Gemma4Attention(cfg, layer_index, groups, shard, group)
        self.mlp = Gemma4MLP(cfg, shard, group, g4.mlp_widths[layer_index])
        self.moe = Gemma4MoE(cfg, shard, group) if cfg.is_moe else None
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        # The MLP's output norm where the experts' joins it (post_feedforward_layernorm_1).
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps) if cfg.is_moe else None
        self.per_layer_input = PerLayerInput(cfg) if g4.per_layer_input_size else None
        self.layer_scalar = nn.Parameter(torch.empty(1))

    def forward(
        self,
        hidden: torch.Tensor,
        per_layer: torch.Tensor | None,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
        on_attention: Callable[[], None] | None,
    ) -> torch.Tensor:
        def norm(x: torch.Tensor, module: RMSNorm) -> torch.Tensor:
            return ops.rms_norm(x, module.weight, module.eps)

        attended = self.self_attn(
            norm(hidden, self.input_layernorm), positions, batch, pool, cos_sin, ops
        )
        if on_attention is not None:
            on_attention()
        hidden = hidden + norm(attended, self.post_attention_layernorm)
        out = self.mlp(norm(hidden, self.pre_feedforward_layernorm), ops)
        if self.moe is not None:
            out = norm(out, self.post_mlp_layernorm) + self.moe(hidden, ops)
        hidden = hidden + norm(out, self.post_feedforward_layernorm)
        if self.per_layer_input is not None:
            hidden = hidden + self.per_layer_input(hidden, per_layer, ops)
        return hidden * self.layer_scalar


class Gemma4ForCausalLM(LlamaForCausalLM):
    """Gemma 4's weights under Hugging Face's names (a multimodal checkpoint's language model read
    as a `Gemma4ForCausalLM`'s), q/k/v fused as Llama's, the MLP's gate and up too."""

    def __init__(
        self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None
    ) -> None:
        nn.Module.__init__(self)  # Llama's layers are not built: Gemma 4's replace them
        shard = shard or TPShard()
        self.config = cfg
        self.shard = shard
        g4 = cfg.gemma4
        groups = model_groups(cfg)
        self.num_cache_layers = cfg.num_cache_layers
        vocab_rows = shard.vocab_rows(cfg.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, group)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(cfg, i, groups, shard, group) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(vocab_rows, cfg.hidden_size, cfg.vocab_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.per_layer_width = g4.per_layer_input_size
        if self.per_layer_width:
            width = cfg.num_layers * self.per_layer_width
            rows = shard.vocab_rows(g4.per_layer_vocab_size)
            self.embed_tokens_per_layer = VocabParallelEmbedding(rows, width, group)
            self.per_layer_model_projection = Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.per_layer_width, cfg.rms_norm_eps)
        # Each layer's rotary table: 0 the full layers' type, 1 the sliding layers' (each as
        # wide as its type's heads).
        local = set(cfg.local_rope_layers)
        self.rope_of = tuple(int(i in local) for i in range(cfg.num_layers))
        for name, table in self._rotary_tables(cfg).items():
            self.register_buffer(name, table, persistent=False)
        placeholders = torch.tensor(g4.placeholder_ids, dtype=torch.int64)
        self.register_buffer("placeholder_ids", placeholders, persistent=False)
        # sqrt(width) of each embedding, rounded to the model's dtype by make_tables.
        self.embed_scale = cfg.hidden_size**0.5
        self.per_layer_embed_scale = self.per_layer_width**0.5

    @property
    def eager_only(self) -> str | None:
        if self.config.is_moe:
            return "Gemma 4's experts run in torch, grouping their tokens on the host"
        return None

    @staticmethod
    def _rotary_tables(cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """`cos_sin` for the full layers' type, `cos_sin_local` for the sliding layers' (each
        for its type's head_dim; a type no layer has gets none)."""
        local = set(cfg.local_rope_layers)
        tables = {}
        for name, is_local, theta, rope in (
            ("cos_sin", False, cfg.rope_theta, cfg.rope_scaling or {}),
            ("cos_sin_local", True, cfg.local_rope_theta, cfg.local_rope_scaling or {}),
        ):
            layers = [i for i in range(cfg.num_layers) if (i in local) == is_local]
            if layers:
                inv = rotary_inv_freq(rope, theta, cfg.head_dim_of(layers[0]))
                tables[name] = rotary_table(inv, cfg.max_position_embeddings)
        return tables

    def make_tables(self, device: str | torch.device) -> None:
        for name, table in self._rotary_tables(self.config).items():
            setattr(self, name, table.to(device))
        self.placeholder_ids = torch.tensor(
            self.config.gemma4.placeholder_ids, dtype=torch.int64, device=device
        )
        # sqrt(width) rounded to the model's dtype, as transformers scales its embeddings.
        dtype = self.embed_tokens.weight.dtype
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5).to(dtype).item()
        self.per_layer_embed_scale = torch.tensor(self.per_layer_width**0.5).to(dtype).item()

    def _per_layer_inputs(
        self, ids: torch.Tensor, embedded: torch.Tensor, ops: Ops
    ) -> torch.Tensor:
        """[tokens, layers, width]: each layer's PLE vector, the token's own per-layer embedding
        and a projection of its embedding (normalised) averaged, times sqrt(2) / 2 each."""
        layers, width = self.config.num_layers, self.per_layer_width
        own = self.embed_tokens_per_layer(ids) * self.per_layer_embed_scale
        projected = self.per_layer_model_projection(embedded) * self.config.hidden_size**-0.5
        norm = self.per_layer_projection_norm
        projected = ops.rms_norm(projected.reshape(-1, width), norm.weight, norm.eps)
        projected = projected.view(-1, layers, width)
        return (projected + own.view(-1, layers, width)) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        ops: Ops,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """on_layer(i) runs once layer i's K/V is in the pool: for the layers that keep KV (the
        pool's layers); a KV-sharing layer writes none."""
        if self.placeholder_ids.numel():  # the multimodal wrapper embeds them as padding
            pad = self.config.gemma4.pad_token_id
            placeholder = torch.isin(input_ids, self.placeholder_ids)
            input_ids = torch.where(placeholder, torch.full_like(input_ids, pad), input_ids)
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = None
        if self.per_layer_width:
            per_layer = self._per_layer_inputs(input_ids, hidden, ops)
        tables = (self.cos_sin, getattr(self, "cos_sin_local", None))
        for index, layer in enumerate(self.layers):
            done = None
            if on_layer is not None and index < self.num_cache_layers:
                done = lambda index=index: on_layer(index)  # noqa: E731
            hidden = layer(
                hidden,
                per_layer[:, index] if per_layer is not None else None,
                positions,
                batch,
                pool,
                tables[self.rope_of[index]],
                ops,
                done,
            )
        return ops.rms_norm(hidden, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap

    # --- loading -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[CheckpointTensor]) -> None:
        """Read this rank's part of each checkpoint tensor; raise naming the first missing,
        unexpected or misshapen weight."""
        readers = self._readers()
        seen: set[str] = set()
        for tensor in weights:
            name = self._text_name(tensor.name)
            if name is None:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            reader = readers.get(name)
            if reader is None:
                if self._unused_by_sharing(name):
                    continue
                raise ValueError(f"unexpected weight '{tensor.name}' in checkpoint")
            reader(tensor)
            seen.add(name)
        missing = sorted(set(readers) - seen)
        if missing:
            raise ValueError(
                f"missing weight '{missing[0]}' in checkpoint ({len(missing)} missing)"
            )

    def _text_name(self, name: str) -> str | None:
        """A weight's name as `Gemma4ForCausalLM` has it; None for the other towers'."""
        if self.config.model_type != "gemma4":
            return name
        if name.startswith(OTHER_TOWERS):
            return None
        if name.startswith(TEXT_PREFIX):
            return "model." + name[len(TEXT_PREFIX) :]
        return name

    def _unused_by_sharing(self, name: str) -> bool:
        """A KV-sharing layer's key or value weights, which transformers does not load either."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return False
        layer = int(parts[2])
        return (
            layer < len(self.layers)
            and not self.layers[layer].self_attn.owns_kv
            and parts[3] == "self_attn"
            and parts[4] in UNUSED_BY_SHARING
        )

    def _readers(self) -> dict[str, Callable[[CheckpointTensor], None]]:
        """Each checkpoint weight's name and what reads this rank's part of it into place."""
        cfg, shard = self.config, self.shard
        hidden = cfg.hidden_size
        vocab = shard.vocab_rows(cfg.vocab_size)
        readers = {
            "model.embed_tokens.weight": part(
                self.embed_tokens.weight, (cfg.vocab_size, hidden), rows=vocab
            ),
            "model.norm.weight": part(self.norm.weight, (hidden,)),
        }
        if not cfg.tie_word_embeddings:
            readers["lm_head.weight"] = part(
                self.lm_head.weight, (cfg.vocab_size, hidden), rows=vocab
            )
        if self.per_layer_width:
            width = cfg.num_layers * self.per_layer_width
            ple_vocab = cfg.gemma4.per_layer_vocab_size
            readers |= {
                "model.embed_tokens_per_layer.weight": part(
                    self.embed_tokens_per_layer.weight,
                    (ple_vocab, width),
                    rows=shard.vocab_rows(ple_vocab),
                ),
                "model.per_layer_model_projection.weight": part(
                    self.per_layer_model_projection.weight, (width, hidden)
                ),
                "model.per_layer_projection_norm.weight": part(
                    self.per_layer_projection_norm.weight, (self.per_layer_width,)
                ),
            }
        for index, layer in enumerate(self.layers):
            readers |= self._layer_readers(f"model.layers.{index}.", index, layer)
        return readers

    def _layer_readers(
        self, p: str, index: int, layer: Gemma4DecoderLayer
    ) -> dict[str, Callable[[CheckpointTensor], None]]:
        cfg, shard = self.config, self.shard
        hidden = cfg.hidden_size
        attn = layer.self_attn
        hd = attn.head_dim
        q = shard.q_heads(cfg.num_heads)
        kv = shard.kv_heads(cfg.kv_heads_of(index))
        q_rows, kv_rows = range(q.start * hd, q.stop * hd), range(kv.start * hd, kv.stop * hd)
        q_all, kv_all = cfg.num_heads * hd, cfg.kv_heads_of(index) * hd
        qkv = attn.qkv_proj.weight
        readers = {
            p + "self_attn.q_proj.weight": part(qkv, (q_all, hidden), rows=q_rows),
            p + "self_attn.o_proj.weight": part(
                attn.o_proj.weight, (hidden, q_all), columns=q_rows
            ),
            p + "self_attn.q_norm.weight": part(attn.q_norm.weight, (hd,)),
        }
        if attn.owns_kv:
            readers[p + "self_attn.k_proj.weight"] = part(
                qkv, (kv_all, hidden), rows=kv_rows, offset=attn.q_size
            )
            readers[p + "self_attn.k_norm.weight"] = part(attn.k_norm.weight, (hd,))
            if not attn.k_eq_v:
                readers[p + "self_attn.v_proj.weight"] = part(
                    qkv, (kv_all, hidden), rows=kv_rows, offset=attn.q_size + attn.kv_size
                )
        width = cfg.gemma4.mlp_widths[index]
        cols = shard.columns(width)
        mlp = layer.mlp
        readers |= {
            p + "mlp.gate_proj.weight": part(mlp.gate_up_proj.weight, (width, hidden), rows=cols),
            p + "mlp.up_proj.weight": part(
                mlp.gate_up_proj.weight, (width, hidden), rows=cols, offset=len(cols)
            ),
            p + "mlp.down_proj.weight": part(mlp.down_proj.weight, (hidden, width), columns=cols),
            p + "layer_scalar": part(layer.layer_scalar, (1,)),
        }
        norms = {
            "input_layernorm": layer.input_layernorm,
            "post_attention_layernorm": layer.post_attention_layernorm,
            "pre_feedforward_layernorm": layer.pre_feedforward_layernorm,
            "post_feedforward_layernorm": layer.post_feedforward_layernorm,
        }
        if layer.per_layer_input is not None:
            ple = layer.per_layer_input
            width = self.per_layer_width
            readers[p + "per_layer_input_gate.weight"] = part(ple.gate.weight, (width, hidden))
            readers[p + "per_layer_projection.weight"] = part(
                ple.projection.weight, (hidden, width)
            )
            norms["post_per_layer_input_norm"] = ple.norm
        if layer.moe is not None:
            readers |= self._moe_readers(p, layer.moe)
            norms |= {
                "post_feedforward_layernorm_1": layer.post_mlp_layernorm,
                "pre_feedforward_layernorm_2": layer.moe.pre_norm,
                "post_feedforward_layernorm_2": layer.moe.post_norm,
            }
        for name, module in norms.items():
            readers[p + name + ".weight"] = part(module.weight, (hidden,))
        return readers

    def _moe_readers(self, p: str, moe: Gemma4MoE) -> dict[str, Callable[[CheckpointTensor], None]]:
        cfg = self.config
        experts, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        cols = moe.columns
        up = range(width + cols.start, width + cols.stop)

        def gate_up(tensor: CheckpointTensor) -> None:  # [E, 2I, H]: gate rows, then up rows
            check_shape(tensor, (experts, 2 * width, hidden))
            with torch.no_grad():
                w13 = moe.experts.w13.data
                w13[:, : len(cols)].copy_(tensor.read_along(1, cols))
                w13[:, len(cols) :].copy_(tensor.read_along(1, up))

        def down(tensor: CheckpointTensor) -> None:  # [E, H, I]
            check_shape(tensor, (experts, hidden, width))
            with torch.no_grad():
                moe.experts.w2.data.copy_(tensor.read_along(2, cols))

        return {
            p + "router.proj.weight": part(moe.router.weight, (experts, hidden)),
            p + "router.scale": part(moe.router_scale, (hidden,)),
            p + "router.per_expert_scale": part(moe.per_expert_scale, (experts,)),
            p + "experts.gate_up_proj": gate_up,
            p + "experts.down_proj": down,
        }


def check_shape(tensor: CheckpointTensor, full: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != full:
        raise ValueError(f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full}")


def part(
    param: torch.Tensor,
    full: tuple[int, ...],
    rows: range | None = None,
    columns: range | None = None,
    offset: int = 0,
) -> Callable[[CheckpointTensor], None]:
    """A reader of a checkpoint weight of shape `full` into `param`: whole, or its rows (placed
    from row `offset` of param, a fused projection) or its columns this rank holds."""

    def read(tensor: CheckpointTensor) -> None:
        check_shape(tensor, full)
        with torch.no_grad():
            if rows is not None:
                param.data.narrow(0, offset, len(rows)).copy_(tensor.read(rows=rows))
            elif columns is not None:
                param.data.copy_(tensor.read(columns=columns))
            else:
                param.data.copy_(tensor.read().view(param.shape))

    return read
