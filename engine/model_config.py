"""Model architecture read from a Hugging Face `config.json`: the dense Llama, Mistral, Qwen2 and
Qwen3 families and their mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE.

Anything this engine cannot run exactly is refused here, with the offending field named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """A checkpoint uses an architecture or option this engine does not implement."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_proj_bias: bool  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (all zero / empty for a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to one
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts'; the rest dense

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    def is_sparse_layer(self, index: int) -> bool:
        return index in self.sparse_layers

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json field 'model_type' = {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"config.json field 'hidden_act' = {act!r} is not supported"
            )
        mistral_like = model_type in ("mistral", "mixtral")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", mistral_like):
            window = cfg["sliding_window"]
            if window < cfg.get("max_position_embeddings", window):
                raise UnsupportedModelError(
                    f"config.json field 'sliding_window' = {window} is not supported"
                )
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("config.json field 'mlp_bias' = true is not supported")
        # transformers 5 writes `rope_parameters` (theta inside); 4.x `rope_theta` + `rope_scaling`.
        rope_parameters = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope_parameters or None
        field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"config.json field '{field}.rope_type' = {rope_type!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            scaling = {**scaling, "rope_type": rope_type}
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qwen2_like = model_type in ("qwen2", "qwen2_moe")
        if model_type == "qwen2_moe":
            attention_bias = bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))
        else:
            attention_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=not qwen2_like and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(model_type, cfg),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies, with Llama-3 or linear scaling applied as transformers does."""

        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = self.rope_scaling
        if not scaling or scaling["rope_type"] == "default":
            return inv
        factor = float(scaling["factor"])
        if scaling["rope_type"] == "linear":
            return inv / factor
        # llama3: keep high frequencies, divide low ones by factor, interpolate between.
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv
        inv_llama = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_llama)


def _moe_fields(model_type: str, cfg: dict) -> dict:
    """The mixture-of-experts fields of a config, as each family's config names them."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    num_layers = cfg["num_hidden_layers"]
    if model_type == "mixtral":
        num_experts = cfg.get("num_local_experts", 8)
        width, shared, renormalize = cfg["intermediate_size"], 0, True
        sparse = tuple(range(num_layers))
    else:
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        width = cfg["moe_intermediate_size"]
        shared = cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        renormalize = bool(cfg.get("norm_topk_prob", False))
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(
            i
            for i in range(num_layers)
            if i not in dense and num_experts > 0 and (i + 1) % step == 0
        )
    top_k = cfg.get("num_experts_per_tok", 2)
    if sparse and not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"config.json field 'num_experts_per_tok' = {top_k} must be between 1 and the "
            f"number of experts ({num_experts})"
        )
    return {
        "num_experts": num_experts if sparse else 0,
        "num_experts_per_tok": top_k if sparse else 0,
        "moe_intermediate_size": width if sparse else 0,
        "shared_expert_intermediate_size": shared if sparse else 0,
        "norm_topk_prob": renormalize,
        "sparse_layers": sparse,
    }
