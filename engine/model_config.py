"""Model architecture read from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3 families).

Anything this engine cannot run exactly is refused here, with the offending field named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
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
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            o_proj_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
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
