"""What the tuner needs to know of a model: its sizes from `config.json`, and what one token costs
in FLOPs and bytes (weights, KV) at a dtype, for rooflines and for the KV a handoff moves.

A mixture of experts holds every expert's weights (memory: `num_params`) and runs k of them per
token (compute: `flops_per_token` counts the active parameters); a step reads the routed experts
its tokens touch (`expert_weight_bytes`, scaled by the step model) besides the rest.

Multi-head latent attention (DeepSeek) caches one latent per token and layer, kv_lora_rank +
qk_rope_head_dim wide, shared by every head; its FLOPs are those of the absorbed form, which
pdserve runs for prefill chunks and decodes alike (`pdserve.engine.models.mla`): each query's
no-rotary part is multiplied into latent space and its output back out (kv_b_proj's two halves,
once per query token), and attention is multi-query attention over the latent. A tensor-parallel
group splits the query heads and holds the latent, and the down-projections that make it, whole
on every rank (`kv_replicas`, `replicated_params`).

Layers that keep different state (`layer_kinds`: full attention, a sliding window, chunked local
attention) form KV groups as a node's pool does (`pdserve.engine.kv.groups`): a long prompt costs
the KV of its full-attention layers per token and at most a window (and a chunk) in each other
layer, and the blocks a sequence holds or a handoff moves are those the KV manager counts.

A block-scaled FP8 checkpoint (DeepSeek-V3's, `fp8_block`) keeps every projection of attention,
the MLPs and the experts at one byte a weight plus a float32 scale a block, as a node holds them
(`pdserve.engine.quant`); embeddings, the LM head, the routers and MLA's kv_b_proj (dequantized
at load) are in the model's dtype. The other quantized formats (`weight_format`: compressed-tensors
FP8, INT8 and W4A16, AWQ, GPTQ, gpt-oss's MXFP4 experts) are sized as their layers hold them
(`pdserve.tune.weight_format`), the same projections quantized."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.engine.embedded.catalog import EMBEDDED, resolve_model_dir
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.groups import KVGroups, groups_for
from pdserve.engine.kv.kv_manager import KVCacheManager
from pdserve.engine.models.config import ModelConfig, UnsupportedModelError
from pdserve.engine.quant.fp8_scheme import Fp8Scheme
from pdserve.kernels.kv_fp8_ref import FP8_KV_DTYPE, row_width
from pdserve.tune.weight_format import WeightFormat

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Mixture of experts: the sparse layers' MLP is `num_experts` experts of
    # `moe_intermediate_size`, `experts_per_token` of them per token, plus an always-on shared
    # expert of `shared_expert_intermediate_size` (0: none).
    num_sparse_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False  # a gate of one output scales the shared expert (Qwen2-MoE)
    # Multi-head latent attention (kv_lora_rank 0: none). head_dim is then the rotary part's
    # width, qk_rope_head_dim, as in ModelConfig.
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Each layer's attention kind as the KV cache sees it ("full", "sliding W", "chunked C";
    # ModelConfig.layer_kinds); empty: every layer full attention.
    layer_kinds: tuple[str, ...] = ()
    # Block-scaled FP8 projections (the checkpoint's weight_block_size); None: every weight in
    # the model's dtype.
    fp8_block: tuple[int, int] | None = None
    # Any other quantized checkpoint's projections (None: fp8_block's, or the model's dtype).
    weight_format: WeightFormat | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig, name: str) -> ModelShape:
        if cfg.has_mixed_kv_shapes or cfg.kv_donors or cfg.gemma4 is not None:
            # Its uniform layers would price Gemma 4's KV and compute wrongly: refused, not guessed.
            raise UnsupportedModelError(
                f"pdserve tune does not model {cfg.model_type} yet (layers of unequal KV shapes, "
                "layers reading another's KV, per-layer embeddings)"
            )
        if cfg.linear_attention is not None:
            # Its uniform layers would price a DeltaNet layer as attention: refused, not guessed.
            raise UnsupportedModelError(
                f"pdserve tune does not model {cfg.model_type} yet (linear-attention layers, "
                "whose state is one block per sequence whatever its length)"
            )
        return cls(
            num_sparse_layers=len(cfg.sparse_layers),
            num_experts=cfg.num_experts,
            experts_per_token=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            shared_expert_gated=cfg.shared_expert_gated and cfg.shared_expert_intermediate_size > 0,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            v_head_dim=cfg.v_head_dim,
            layer_kinds=cfg.layer_kinds,
            fp8_block=_fp8_block(cfg),
            weight_format=WeightFormat.from_scheme(cfg.quantization),
            name=name,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        """From a checkpoint directory's config.json (a directory holding only that will do)."""
        path = Path(model_dir)
        return cls.from_config(ModelConfig.from_pretrained(path), path.name)

    @classmethod
    def from_dict(cls, d: dict) -> ModelShape:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "layer_kinds" in fields:  # a JSON list
            fields["layer_kinds"] = tuple(fields["layer_kinds"])
        if fields.get("fp8_block") is not None:
            fields["fp8_block"] = tuple(fields["fp8_block"])
        if isinstance(fields.get("weight_format"), dict):
            fields["weight_format"] = WeightFormat(**fields["weight_format"])
        return cls(**fields)

    def to_dict(self) -> dict:
        return asdict(self)

    def same_shape(self, other: ModelShape) -> bool:
        mine, theirs = self.to_dict(), other.to_dict()
        mine.pop("name"), theirs.pop("name")
        return mine == theirs

    # --- the cache ------------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def cache_heads(self) -> int:
        """KV heads cached per token and layer: MLA's latent is one, shared by every head."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Width of one cached head: MLA's latent c_kv beside its rotary key k_pe."""
        return self.kv_lora_rank + self.head_dim if self.is_mla else self.head_dim

    @property
    def cache_planes(self) -> int:
        """K and V, or MLA's latent alone."""
        return 1 if self.is_mla else 2

    def kv_layout(self, block_size: int, dtype: str) -> KVLayout:
        """The layout of a whole node's pool (every KV head) for this shape."""
        return KVLayout(
            self.num_layers,
            block_size,
            self.cache_heads,
            self.cache_head_dim,
            dtype,
            self.cache_planes,
            self.layer_kinds,
        )

    @property
    def kv_groups(self) -> KVGroups:
        """The layers' KV groups: one of every layer unless the model mixes layer kinds."""
        return groups_for(self.num_layers, self.layer_kinds)

    def kv_manager(self, block_size: int) -> KVCacheManager:
        """A KV manager of this shape's groups, for its count of one sequence's blocks
        (`peak_blocks`, `handoff_size`); the one-block pool under it is never used."""
        return KVCacheManager(BlockManager(1, block_size), self.kv_groups)

    @property
    def num_full_layers(self) -> int:
        """Layers whose queries read every earlier token."""
        return sum(1 for kind in self.kv_groups.kinds if kind.reach is None)

    def kv_replicas(self, gpus: int) -> int:
        """Copies of every cached head a tensor-parallel group of `gpus` holds: 1 where the KV
        heads split over the ranks, gpus / heads where ranks share a head (MLA's latent is on
        every rank). Each copy is stored, read by its rank's attention and sent by it."""
        return max(1, gpus // self.cache_heads)

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def q_head_dim(self) -> int:
        """Width of one query head: MLA's no-rotary and rotary parts, else head_dim."""
        return self.qk_nope_head_dim + self.head_dim if self.is_mla else self.head_dim

    @property
    def attention_params(self) -> int:
        """Matmul weights of one layer's attention: q, k, v and o projections; for MLA q_a_proj
        and q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj."""
        h, heads = self.hidden_size, self.num_heads
        if not self.is_mla:
            q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
            return h * (q + 2 * kv) + q * h
        q_out = heads * self.q_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else h * q_out
        kv_a = h * self.cache_head_dim
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + heads * self.v_head_dim * h

    def replicated_params(self, gpus: int) -> int:
        """Matmul weights a tensor-parallel group of `gpus` holds beyond one copy of the model:
        what every rank holds whole (MLA's q_a_proj and kv_a_proj_with_mqa, which make codes
        that have no heads to split; a mixture of experts' router) and the K and V projections
        of KV heads that ranks share. Each extra copy is stored, read and computed by its rank."""
        if gpus <= 1:
            return 0
        h = self.hidden_size
        if self.is_mla:
            attention = (gpus - 1) * h * (self.q_lora_rank + self.cache_head_dim)
        else:
            attention = (self.kv_replicas(gpus) - 1) * 2 * h * self.num_kv_heads * self.head_dim
        router = h * (self.num_experts + (1 if self.shared_expert_gated else 0))
        return self.num_layers * attention + self.num_sparse_layers * (gpus - 1) * router

    @property
    def layer_params(self) -> int:
        """Matmul weights of one dense decoder layer: attention and the gated MLP."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert's gated MLP."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def sparse_layer_fixed_params(self) -> int:
        """What every token of a sparse layer uses: attention, the router, the shared expert."""
        shared = self.shared_expert_intermediate_size
        router = self.hidden_size * (self.num_experts + (1 if self.shared_expert_gated else 0))
        return self.attention_params + router + 3 * self.hidden_size * shared

    @property
    def layers_params(self) -> int:
        """Every decoder layer's matmul weights, every expert counted."""
        dense = self.num_layers - self.num_sparse_layers
        sparse = self.sparse_layer_fixed_params + self.num_experts * self.expert_params
        return dense * self.layer_params + self.num_sparse_layers * sparse

    @property
    def active_layers_params(self) -> int:
        """The decoder layers' matmul weights one token uses (its k experts of each sparse layer)."""
        dense = self.num_layers - self.num_sparse_layers
        sparse = self.sparse_layer_fixed_params + self.experts_per_token * self.expert_params
        return dense * self.layer_params + self.num_sparse_layers * sparse

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.layers_params + self.embedding_params + head

    def weight_bytes(self, dtype: str) -> int:
        """Every weight as a node holds it: the projections in FP8 with their scales where the
        checkpoint is, the rest in `dtype`."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.layers_weight_bytes(dtype) + (self.embedding_params + head) * DTYPE_BYTES[dtype]

    def weights_label(self, dtype: str) -> str:
        """How the weights are held, for messages: `bfloat16`, or FP8 beside it."""
        if self.weight_format is not None:
            return f"{self.weight_format.label} and {dtype}"
        if self.fp8_block is None:
            return dtype
        return f"fp8 (blocks of {self.fp8_block[0]}x{self.fp8_block[1]}) and {dtype}"

    def matrix_bytes(self, rows: int, cols: int, dtype: str, expert: bool = False) -> int:
        """One projection's weight [rows, cols] (of a routed expert: `expert`): in `dtype`, FP8
        and a float32 scale a block, or as `weight_format`'s layer holds it."""
        fmt = self.weight_format
        if fmt is not None and (expert or not fmt.experts_only):
            return fmt.matrix_bytes(rows, cols)
        if self.fp8_block is None:
            return rows * cols * DTYPE_BYTES[dtype]
        b0, b1 = self.fp8_block
        return rows * cols + 4 * -(-rows // b0) * -(-cols // b1)

    def attention_matrices(self) -> list[tuple[int, int]]:
        """One layer's attention projections, [rows, cols] each (their sizes sum to
        `attention_params`); MLA's down-projections first."""
        h, heads = self.hidden_size, self.num_heads
        if not self.is_mla:
            q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
            return [(kv, h), (kv, h), (q, h), (h, q)]
        q_out = heads * self.q_head_dim
        if self.q_lora_rank:
            q = [(self.q_lora_rank, h), (q_out, self.q_lora_rank)]
        else:
            q = [(q_out, h)]
        kv_b = (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        return [*q, (self.cache_head_dim, h), kv_b, (h, heads * self.v_head_dim)]

    def mlp_bytes(self, width: int, dtype: str, expert: bool = False) -> int:
        """A gated MLP of `width` (a routed expert's: `expert`): gate, up and down projections."""
        gate_up = 2 * self.matrix_bytes(width, self.hidden_size, dtype, expert)
        return gate_up + self.matrix_bytes(self.hidden_size, width, dtype, expert)

    def expert_bytes(self, dtype: str) -> int:
        """One routed expert as held."""
        return self.mlp_bytes(self.moe_intermediate_size, dtype, expert=True)

    def layers_weight_bytes(self, dtype: str) -> int:
        """Every decoder layer's matmul weights as held, every expert counted. MLA's kv_b_proj
        is held in `dtype` whatever the checkpoint: a node folds it into each head's query and
        output at load (`pdserve.engine.models.mla`)."""
        matrices = self.attention_matrices()
        attention = sum(self.matrix_bytes(r, c, dtype) for r, c in matrices)
        if self.is_mla:
            rows, cols = matrices[-2]  # kv_b_proj
            attention += rows * cols * DTYPE_BYTES[dtype] - self.matrix_bytes(rows, cols, dtype)
        dense = self.num_layers - self.num_sparse_layers
        router = self.hidden_size * (self.num_experts + (1 if self.shared_expert_gated else 0))
        sparse = (
            attention
            + router * DTYPE_BYTES[dtype]
            + (self.mlp_bytes(self.shared_expert_intermediate_size, dtype))
            + self.num_experts * self.expert_bytes(dtype)
        )
        dense_bytes = attention + self.mlp_bytes(self.intermediate_size, dtype)
        return dense * dense_bytes + self.num_sparse_layers * sparse

    def replicated_bytes(self, gpus: int, dtype: str) -> int:
        """`replicated_params` as held: MLA's down-projections (or shared K and V projections)
        quantized where the checkpoint is, the router in `dtype`."""
        if gpus <= 1:
            return 0
        h = self.hidden_size
        if self.is_mla:  # q_a_proj and kv_a_proj_with_mqa (q_proj splits by heads)
            kv_a = (self.cache_head_dim, h)
            held = [(self.q_lora_rank, h), kv_a] if self.q_lora_rank else [kv_a]
            copies = gpus - 1
        else:  # k_proj and v_proj
            copies, held = self.kv_replicas(gpus) - 1, self.attention_matrices()[:2]
        attention = copies * sum(self.matrix_bytes(r, c, dtype) for r, c in held)
        router = h * (self.num_experts + (1 if self.shared_expert_gated else 0))
        routers = self.num_sparse_layers * (gpus - 1) * router * DTYPE_BYTES[dtype]
        return self.num_layers * attention + routers

    def kv_bytes_per_layer_token(self, dtype: str) -> int:
        """One token's cache in one layer, one copy: K and V of every KV head, or MLA's latent
        (kv_lora_rank + qk_rope_head_dim). `dtype` is the KV layout's (`EngineConfig.kv_dtype`):
        with an FP8 cache each (token, head) row is a byte a value and its float32 scale."""
        rows = self.cache_planes * self.cache_heads
        if dtype == FP8_KV_DTYPE:
            return rows * row_width(self.cache_head_dim)
        return rows * self.cache_head_dim * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """What one more token of a long context adds to the cache, one copy: its KV in every
        full-attention layer (every layer, unless the model mixes kinds); a windowed or chunked
        layer holds at most its reach and a chunk, whatever the length (`kv_window_bytes`)."""
        return self.num_full_layers * self.kv_bytes_per_layer_token(dtype)

    def kv_window_bytes(self, dtype: str) -> int:
        """The most one sequence's windowed and chunked layers read in a decode step, one copy:
        each such layer's reach and the query's own token."""
        reach = sum(k.reach + 1 for k in self.kv_groups.kinds if k.reach is not None)
        return reach * self.kv_bytes_per_layer_token(dtype)

    def kv_bytes_per_block(self, block_size: int, dtype: str) -> int:
        """One block of a node's pool, one copy: a page of each of its slots (a layer each; the
        largest group's layers where the model mixes kinds)."""
        return self.kv_layout(block_size, dtype).bytes_per_block

    def kv_blocks_held(self, num_tokens: int, block_size: int, max_chunk: int = 1) -> int:
        """The most blocks one sequence of num_tokens holds at once, computed in chunks of at
        most max_chunk tokens (1: decoding), as the KV manager counts them (`peak_blocks`)."""
        return self.kv_manager(block_size).peak_blocks(num_tokens, max_chunk)

    def kv_handoff_bytes(self, num_tokens: int, block_size: int, dtype: str) -> int:
        """What the handoff of a prompt of num_tokens moves, one copy: the blocks each group's
        next query reads (every block of a full group), whole blocks of the pool."""
        blocks = self.kv_manager(block_size).handoff_size(num_tokens)
        return blocks * self.kv_bytes_per_block(block_size, dtype)

    # --- work -----------------------------------------------------------------------------------

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs of every layer for one new token (attention over the context aside): its
        active parameters, in a mixture of experts. MLA's absorbed form uses kv_b_proj's weights
        once a query token (the query into latent space, the output out of it) and never on a
        key, so its count is the parameters' too."""
        return 2.0 * self.active_layers_params

    @property
    def flops_per_attention_pair(self) -> float:
        """QK^T and PV for one (query token, key token) pair, across layers and heads; for MLA
        in the absorbed form, each head's scores over the whole latent (kv_lora_rank +
        qk_rope_head_dim) and its values over c_kv (kv_lora_rank)."""
        if self.is_mla:
            return 2.0 * self.num_layers * self.num_heads * (2 * self.kv_lora_rank + self.head_dim)
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    @property
    def flops_per_logits_row(self) -> float:
        """The LM head for one sampled position."""
        return 2.0 * self.hidden_size * self.vocab_size

    def step_weight_bytes(self, dtype: str) -> int:
        """Weights a step reads whatever its batch: every layer but its routed experts, and the
        LM head (tied or not); of the embedding table only its tokens' rows, which are left out."""
        fixed = self.layers_weight_bytes(dtype) - self.expert_weight_bytes(dtype)
        return fixed + self.embedding_params * DTYPE_BYTES[dtype]

    def expert_weight_bytes(self, dtype: str) -> int:
        """Every routed expert of every sparse layer: what a step reads when its tokens touch
        them all."""
        return self.num_sparse_layers * self.num_experts * self.expert_bytes(dtype)


# The shapes of models not at hand, from their published config.json (weights aside).
PRESETS = {
    "llama3-8b": ModelShape("Meta-Llama-3-8B", 32, 4096, 14336, 32, 8, 128, 128256, 8192),
    "llama3-70b": ModelShape("Meta-Llama-3-70B", 80, 8192, 28672, 64, 8, 128, 128256, 8192),
    "mixtral-8x7b": ModelShape(
        "Mixtral-8x7B-v0.1",
        32,
        4096,
        14336,
        32,
        8,
        128,
        32000,
        32768,
        num_sparse_layers=32,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=14336,
    ),
    "qwen3-30b-a3b": ModelShape(
        "Qwen3-30B-A3B",
        48,
        2048,
        6144,
        32,
        4,
        128,
        151936,
        40960,
        num_sparse_layers=48,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
    ),
    # DeepSeek: latent attention (head_dim is qk_rope_head_dim), first_k_dense_replace dense
    # layers, then routed experts beside always-on shared ones. V3's multi-token prediction
    # layer (num_nextn_predict_layers, 14 B more) is not counted: pdserve does not run it. V3
    # is published in FP8, blocks of 128x128.
    "deepseek-v3": ModelShape(
        "DeepSeek-V3",
        61,
        7168,
        18432,
        128,
        128,
        64,
        129280,
        163840,
        num_sparse_layers=58,
        num_experts=256,
        experts_per_token=8,
        moe_intermediate_size=2048,
        shared_expert_intermediate_size=2048,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        v_head_dim=128,
        fp8_block=(128, 128),
    ),
    "deepseek-v2-lite": ModelShape(
        "DeepSeek-V2-Lite",
        27,
        2048,
        10944,
        16,
        16,
        64,
        102400,
        163840,
        num_sparse_layers=26,
        num_experts=64,
        experts_per_token=6,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=2816,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),
}


def _fp8_block(cfg: ModelConfig) -> tuple[int, int] | None:
    """The FP8 block of a block-scaled FP8 checkpoint's config; None for any other."""
    return cfg.quantization.block if isinstance(cfg.quantization, Fp8Scheme) else None


def model_shape(model: str | None) -> ModelShape:
    """A checkpoint directory, its config.json, a preset name, an embedded model's name, or None
    (the default model, as serve's)."""
    if model in PRESETS:
        return PRESETS[model]
    if model is None or model in EMBEDDED:
        return ModelShape.from_model_dir(resolve_model_dir(model))
    path = Path(model)
    if path.is_file():
        return ModelShape.from_config(
            ModelConfig.from_dict(json.loads(path.read_text())), path.parent.name
        )
    if path.is_dir():
        return ModelShape.from_model_dir(path)
    raise ValueError(f"model {model!r}: not a directory, a config.json or one of {list(PRESETS)}")
