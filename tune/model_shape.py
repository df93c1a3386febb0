"""What the tuner needs to know of a model: its sizes from `config.json`, and what one token costs
in FLOPs and bytes (weights, KV) at a dtype, for rooflines and for the KV a handoff moves.

A mixture of experts holds every expert's weights (memory: `num_params`) and runs k of them per
token (compute: `flops_per_token` counts the active parameters); a step reads the routed experts
its tokens touch (`expert_weight_bytes`, scaled by the step model) besides the rest."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.engine.embedded_models import EMBEDDED, resolve_model_dir
from pdserve.engine.model_config import ModelConfig

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

    @classmethod
    def from_config(cls, cfg: ModelConfig, name: str) -> ModelShape:
        return cls(
            num_sparse_layers=len(cfg.sparse_layers),
            num_experts=cfg.num_experts,
            experts_per_token=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
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
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return asdict(self)

    def same_shape(self, other: ModelShape) -> bool:
        mine, theirs = self.to_dict(), other.to_dict()
        mine.pop("name"), theirs.pop("name")
        return mine == theirs

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def attention_params(self) -> int:
        """Matmul weights of one layer's attention: q, k, v and o projections."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * (q + 2 * kv) + q * h

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
        router = self.hidden_size * (self.num_experts + (1 if shared else 0))
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
        return self.num_params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one token across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def kv_bytes_per_block(self, block_size: int, dtype: str) -> int:
        return block_size * self.kv_bytes_per_token(dtype)

    # --- work -----------------------------------------------------------------------------------

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs of every layer for one new token (attention over the context aside): its
        active parameters, in a mixture of experts."""
        return 2.0 * self.active_layers_params

    @property
    def flops_per_attention_pair(self) -> float:
        """QK^T and PV for one (query token, key token) pair, across layers and heads."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    @property
    def flops_per_logits_row(self) -> float:
        """The LM head for one sampled position."""
        return 2.0 * self.hidden_size * self.vocab_size

    def step_weight_bytes(self, dtype: str) -> int:
        """Weights a step reads whatever its batch: every layer but its routed experts, and the
        LM head (tied or not); of the embedding table only its tokens' rows, which are left out."""
        fixed = self.layers_params - self.num_sparse_layers * self.num_experts * self.expert_params
        return (fixed + self.embedding_params) * DTYPE_BYTES[dtype]

    def expert_weight_bytes(self, dtype: str) -> int:
        """Every routed expert of every sparse layer: what a step reads when its tokens touch
        them all."""
        experts = self.num_sparse_layers * self.num_experts * self.expert_params
        return experts * DTYPE_BYTES[dtype]


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
}


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
