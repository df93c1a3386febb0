"""Model architecture read from a Hugging Face `config.json`: the dense Llama, Mistral, Qwen2 and
Qwen3 families, their mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE, DeepSeek-V2 and
V3 (multi-head latent attention, group-limited routing over many small experts), gpt-oss
(attention sinks, alternating windowed and full layers, experts with biases and a clamped SwiGLU),
Gemma 3's text model (`gemma3_text`, and the language model of a multimodal `gemma3`
checkpoint), Gemma 4's (`gemma4_text`, `gemma4`: layers of unequal KV shapes, layers reading an
earlier layer's KV, per-layer embeddings, an optional mixture of experts beside the MLP) and
Llama 4's (chunked local and NoPE layers, interleaved dense and sparse layers), and the hybrids of
Gated DeltaNet (linear attention) and gated full-attention layers: Qwen3.5's text model
(`qwen3_5_text`, and the language model of a multimodal `qwen3_5` checkpoint), Qwen3.5-MoE's
(`qwen3_5_moe_text`, `qwen3_5_moe`) and Qwen3-Next (`qwen3_next`).

Anything this engine cannot run exactly is refused here, with the offending field named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.quant.scheme import QuantScheme, UnsupportedQuantizationError, refuse
from pdserve.engine.quant.schemes import scheme_from_config

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "llama4_text",
    "llama4",  # Llama4ForConditionalGeneration: its text model only
    "gpt_oss",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "gemma4",  # Gemma4ForConditionalGeneration: its text model only
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5",  # Qwen3_5ForConditionalGeneration: its text model only
    "qwen3_5_moe_text",
    "qwen3_5_moe",  # Qwen3_5MoeForConditionalGeneration: its text model only
)
# The families whose checkpoints may hold quantized linear layers (`pdserve.engine.quant`); in
# those of them with experts, only under a scheme that stacks quantized experts (`experts`).
QUANTIZED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
)
# Formats that quantize one family's own layers, by quant_method: the model types they load into.
FAMILY_QUANT_METHODS = {"mxfp4": ("gpt_oss",)}  # gpt-oss's experts
GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
GEMMA4_MODEL_TYPES = ("gemma4_text", "gemma4")
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# The Gated DeltaNet hybrids, by the text model's type (a multimodal wrapper's is read as it).
QWEN3_NEXT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QWEN3_5_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Their MoE kin with a shared expert scaled by its sigmoid gate.
GATED_SHARED_EXPERT_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
MOE_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    *DEEPSEEK_MODEL_TYPES,
    "gpt_oss",
    "llama4_text",
    "qwen3_next",
    "qwen3_5_moe_text",
)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
# Families with a per-head RMSNorm on q and k before rotary.
QK_NORM_MODEL_TYPES = (
    "qwen3",
    "qwen3_moe",
    *GEMMA3_MODEL_TYPES,
    *GEMMA4_MODEL_TYPES,
    *QWEN3_NEXT_MODEL_TYPES,
)


class UnsupportedModelError(ValueError):
    """A checkpoint uses an architecture or option this engine does not implement."""


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: the gate clamped above at `limit`, the up projection clamped
    to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


@dataclass(frozen=True, slots=True)
class Llama4Attention:
    """What Llama 4's attention does to q and k beyond Llama's: rotary (its pairs interleaved,
    (2i, 2i + 1)) only on the layers `rope_layers` marks, then on those an L2 norm of each head
    (`qk_l2_norm`); on the others (NoPE) q scaled by 1 + attn_scale * log1p(floor((position + 1)
    / floor_scale)) where `temperature_tuning`."""

    rope_layers: tuple[bool, ...]
    qk_l2_norm: bool
    temperature_tuning: bool
    floor_scale: float
    attn_scale: float


@dataclass(frozen=True, slots=True)
class Gemma4Text:
    """What Gemma 4's text model adds beyond what ModelConfig says of every family (its layers'
    KV shapes, `kv_donors`, the rope of its two layer types and its MoE are ModelConfig's).

    per_layer_input_size: the width of each layer's per-layer embedding (PLE; 0: none), looked
    up in a table of per_layer_vocab_size rows. k_eq_v_layers: the layers whose values are their
    keys' projection (attention_k_eq_v, on full-attention layers). mlp_widths: each layer's MLP
    width (twice intermediate_size on the layers that read another's KV, with
    use_double_wide_mlp). placeholder_ids: the multimodal wrapper's image, video and audio
    tokens, embedded as pad_token_id as transformers does on text."""

    per_layer_input_size: int
    per_layer_vocab_size: int
    k_eq_v_layers: tuple[bool, ...]
    mlp_widths: tuple[int, ...]
    pad_token_id: int
    placeholder_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """The linear-attention (Gated DeltaNet) layers of a hybrid model (Qwen3-Next, Qwen3.5):
    their heads and the width of their causal convolution. Their layers are those whose
    `layer_kinds` entry is "linear"."""

    num_k_heads: int  # linear_num_key_heads
    num_v_heads: int  # linear_num_value_heads
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim


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
    shared_expert_gated: bool = False  # the shared expert's output scaled by sigmoid(gate(x))
    # DeepSeek's routing: softmax (V2) or sigmoid (V3) scores; the experts fall in n_group groups
    # of which each token may use topk_group, ranked by their best score (V2) or the sum of their
    # two best corrected scores (V3); the k weights are scaled by routed_scaling_factor.
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # V3's e_score_correction_bias, added for choosing only
    # Multi-head latent attention (DeepSeek; kv_lora_rank 0: none). head_dim is then the rotary
    # part's width, qk_rope_head_dim, as transformers has it.
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs are (2i, 2i+1), not (i, i + d/2)
    # Each layer's attention kind as the KV cache sees it ("full", "sliding W", "chunked C",
    # `pdserve.engine.kv.layer_kinds`); empty: every layer full attention.
    layer_kinds: tuple[str, ...] = ()
    # Llama 4 (None for every other family); its MoE layers are `llama4.Llama4MoE`'s.
    llama4: Llama4Attention | None = None
    # A multimodal checkpoint's prefix of its text model's weights ("language_model."); weights
    # outside it (the vision tower, the projector) are not read.
    weights_prefix: str = ""
    # gpt-oss: a learned logit per query head joins every attention softmax's denominator.
    attention_sinks: bool = False
    # gpt-oss's experts (None: the gated SiLU of the other families): biases on the expert and
    # router projections, the router's softmax over its k largest logits, this activation.
    clamped_swiglu: ClampedSwiGLU | None = None
    # Gemma 3 and 4: its MLP's activation (GeGLU), query_pre_attn_scalar (what the softmax scale
    # is 1/sqrt of; 0: head_dim; Gemma 4 scales by 1), a tanh cap on the logits (0: none), and the
    # rope of its sliding layers (`local_rope_layers`): a base and scaling apart from the full
    # layers' rope_theta and rope_scaling.
    mlp_activation: str = "silu"
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0
    local_rope_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0
    local_rope_scaling: dict | None = None
    # Layers whose KV pages differ in shape (Gemma 4): each layer's KV heads and head_dim (empty:
    # every layer's are num_kv_heads and head_dim).
    layer_kv_heads: tuple[int, ...] = ()
    layer_head_dims: tuple[int, ...] = ()
    # By layer, the layer whose keys and values it attends over: itself, or an earlier one whose
    # KV it reads and keeps none of its own (Gemma 4's num_kv_shared_layers, always the last
    # layers). Empty: every layer its own.
    kv_donors: tuple[int, ...] = ()
    # Gemma 4 (None for every other family); its modules are `gemma4`'s.
    gemma4: Gemma4Text | None = None
    # The linear-attention layers of a hybrid model (None: it has none).
    linear_attention: LinearAttention | None = None
    # Rotary turns only the first rotary_dim of each head's dimensions (Qwen3-Next's and
    # Qwen3.5's partial_rotary_factor); 0: all head_dim of them.
    rotary_dim: int = 0
    # The checkpoint's quantized weights (None: plain float weights).
    quantization: QuantScheme | None = None

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @property
    def num_cache_layers(self) -> int:
        """Layers that keep KV pages of their own: the leading ones (the others read theirs)."""
        if not self.kv_donors:
            return self.num_layers
        return sum(1 for layer, donor in enumerate(self.kv_donors) if donor == layer)

    @property
    def has_mixed_kv_shapes(self) -> bool:
        return bool(self.layer_kv_heads)

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def cache_heads(self) -> int:
        """KV heads the paged cache holds per token and layer: MLA's latent is one, shared by
        every query head."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Width of one cached head: MLA's latent c_kv beside its rotary key k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def cache_planes(self) -> int:
        """Tensors the cache keeps per head: K and V, or MLA's latent alone."""
        return 1 if self.is_mla else 2

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1/sqrt(query-key width, or Gemma's query_pre_attn_scalar), times
        YaRN's mscale squared for MLA with `mscale_all_dim`, as DeepSeek's attention has it."""
        if not self.is_mla:
            return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = self.rope_scaling
        if scaling and scaling["rope_type"] != "default" and scaling.get("mscale_all_dim"):
            mscale = _yarn_mscale(self._rope_factor(), float(scaling["mscale_all_dim"]))
            scale *= mscale * mscale
        return scale

    def rotary_attention_factor(self) -> float:
        """What YaRN scales cos and sin by (1.0 for every other rotary type)."""
        scaling = self.rope_scaling
        if not scaling or scaling["rope_type"] != "yarn":
            return 1.0
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = self._rope_factor()
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return _yarn_mscale(factor)

    def _rope_factor(self) -> float:
        scaling = self.rope_scaling
        if scaling.get("factor") is not None:
            return float(scaling["factor"])
        old_context = scaling.get("original_max_position_embeddings")
        return self.max_position_embeddings / float(old_context or self.max_position_embeddings)

    def is_sparse_layer(self, index: int) -> bool:
        return index in self.sparse_layers

    @property
    def rope_dim(self) -> int:
        """The dimensions of a head that rotary turns: the width of the rotary table."""
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json field 'model_type' = {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        weights_prefix = ""
        if model_type == "llama4":  # the multimodal checkpoint: its text model
            cfg, model_type = _llama4_text_config(cfg), "llama4_text"
            weights_prefix = "language_model."
        if model_type == "llama4_text":
            cfg = _llama4_defaults(cfg)
        if model_type == "gpt_oss":
            cfg = _gpt_oss_defaults(cfg)
        if model_type in GEMMA3_MODEL_TYPES:
            cfg = _gemma3_text_config(cfg)
        if model_type in GEMMA4_MODEL_TYPES:
            cfg = _gemma4_text_config(cfg)
        if model_type in QWEN3_5_WRAPPERS:  # the multimodal checkpoint: its text model
            cfg = _qwen3_5_text_config(cfg)
            model_type = cfg["model_type"]
        if model_type in QWEN3_NEXT_MODEL_TYPES:
            cfg = _qwen3_next_config(cfg)
        quantization = _quantization(model_type, cfg.get("quantization_config"))
        act = cfg.get("hidden_act", "silu")
        # gpt-oss's transformers model reads no hidden_act: its experts' activation is fixed.
        if act != "silu" and model_type != "gpt_oss":
            raise UnsupportedModelError(
                f"config.json field 'hidden_act' = {act!r} is not supported"
            )
        layer_kinds = _layer_kinds(model_type, cfg)
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("config.json field 'mlp_bias' = true is not supported")
        # transformers 5 writes `rope_parameters` (theta inside); 4.x `rope_theta` + `rope_scaling`.
        rope_parameters = cfg.get("rope_parameters") or {}
        default_theta = DEFAULT_ROPE_THETA.get(model_type, 10000.0)
        rope_theta = cfg.get("rope_theta", rope_parameters.get("rope_theta", default_theta))
        scaling = cfg.get("rope_scaling") or rope_parameters or None
        field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            supported = (
                GEMMA4_ROPE_TYPES if model_type in GEMMA4_MODEL_TYPES else SUPPORTED_ROPE_TYPES
            )
            if rope_type not in supported:
                raise UnsupportedModelError(
                    f"config.json field '{field}.rope_type' = {rope_type!r} is not supported "
                    f"(supported: {', '.join(supported)})"
                )
            scaling = {**scaling, "rope_type": rope_type}
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        mla = _mla_fields(model_type, cfg)
        if mla:
            head_dim = mla["qk_rope_head_dim"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qwen2_like = model_type in ("qwen2", "qwen2_moe")
        if model_type == "qwen2_moe":
            attention_bias = bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))
        else:
            attention_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        if mla and attention_bias:
            raise UnsupportedModelError(
                f"config.json field 'attention_bias' = true is not supported for {model_type}"
            )
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # Llama 4's dense layers are intermediate_size_mlp wide (its experts intermediate_size).
            intermediate_size=cfg["intermediate_size_mlp"]
            if model_type == "llama4_text"
            else cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            quantization=quantization,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=not qwen2_like and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(model_type, cfg),
            **mla,
            layer_kinds=layer_kinds,
            llama4=_llama4_attention(cfg) if model_type == "llama4_text" else None,
            weights_prefix=weights_prefix,
            attention_sinks=model_type == "gpt_oss",
            clamped_swiglu=(
                ClampedSwiGLU(float(cfg["swiglu_alpha"]), float(cfg["swiglu_limit"]))
                if model_type == "gpt_oss"
                else None
            ),
            **_gemma3_fields(model_type, cfg),
            **_gemma4_fields(model_type, cfg),
            **_qwen3_next_fields(model_type, cfg),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies, with Llama-3, linear or YaRN scaling applied as
        transformers does."""
        dim = self.rope_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = self.rope_scaling
        if not scaling or scaling["rope_type"] == "default":
            return inv
        if scaling["rope_type"] == "yarn":
            return self._yarn_inv_freq(inv)
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

    def _yarn_inv_freq(self, inv: torch.Tensor) -> torch.Tensor:
        """YaRN: extrapolate the fast dimensions, interpolate (divide by factor) the slow ones,
        ramp linearly between the dimensions where beta_fast and beta_slow rotations fit the
        original context."""
        scaling, dim, base = self.rope_scaling, self.rope_dim, self.rope_theta
        factor = self._rope_factor()
        old_context = float(
            scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        )
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        interpolated = 1.0 / (factor * pos_freqs)
        return interpolated * (1 - extrapolate) + inv * extrapolate


# transformers' default rope_theta where a config names none (Llama's 10000 for the others).
DEFAULT_ROPE_THETA = {"gpt_oss": 150000.0, "llama4_text": 500000.0}


def _gpt_oss_defaults(cfg: dict) -> dict:
    """A gpt-oss config with what transformers' GptOssConfig supplies where config.json is
    silent: its own defaults (not Llama's), layers alternating sliding and full from a sliding
    first, and YaRN when no rope scaling is named."""
    cfg = {
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        **cfg,
    }
    if cfg.get("layer_types") is None:
        cfg["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg["rope_parameters"] = {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        }
    return cfg


def _quantization(model_type: str, qcfg: dict | None) -> QuantScheme | None:
    """The scheme of a quantized checkpoint (`pdserve.engine.quant.schemes`) in the linear
    layers (and experts, latent attention) of the families that read it, or in gpt-oss's experts
    (MXFP4); every other method, value or family refused by field."""
    if not qcfg:
        return None
    if not isinstance(qcfg, dict):
        raise UnsupportedModelError(
            f"config.json field 'quantization_config' = {qcfg!r} is not supported (an object)"
        )
    method = qcfg.get("quant_method")
    family_types = FAMILY_QUANT_METHODS.get(method) if isinstance(method, str) else None
    if family_types is not None and model_type not in family_types:
        raise UnsupportedModelError(
            f"config.json field 'quantization_config.quant_method' = {method!r} is not "
            f"supported for model_type {model_type!r} (it quantizes "
            f"{', '.join(family_types)} checkpoints' experts only)"
        )
    own = [m for m, types in FAMILY_QUANT_METHODS.items() if model_type in types]
    if family_types is None and own:  # a family that loads its own format only
        supported = f"{', '.join(repr(m) for m in own)} for model_type {model_type!r}"
        raise UnsupportedModelError(str(refuse("quant_method", method, supported)))
    if family_types is None and model_type not in QUANTIZED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"config.json field 'quantization_config' ({method or '?'}) is not supported for "
            f"model_type {model_type!r} yet: quantized weights load into the "
            f"{', '.join(QUANTIZED_MODEL_TYPES)} families only"
        )
    try:
        scheme = scheme_from_config(qcfg)
    except UnsupportedQuantizationError as err:
        raise UnsupportedModelError(str(err)) from None
    if family_types is None and model_type in MOE_MODEL_TYPES and not hasattr(scheme, "experts"):
        raise UnsupportedModelError(
            f"config.json field 'quantization_config.quant_method' = {qcfg.get('quant_method')!r}"
            f" is not supported for model_type {model_type!r} yet: pdserve keeps {scheme.label}"
            " in linear layers, not yet in a mixture of experts' stacked experts"
        )
    return scheme


def _llama4_text_config(cfg: dict) -> dict:
    """The text model's config of a Llama4ForConditionalGeneration checkpoint: its
    `text_config` (whose tie_word_embeddings transformers follows, not the wrapper's), with the
    wrapper's dtype and quantization where the text config names none."""
    text = dict(cfg.get("text_config") or {})
    for key in ("torch_dtype", "dtype", "quantization_config"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return {**text, "model_type": "llama4_text"}


def _llama4_defaults(cfg: dict) -> dict:
    """A Llama 4 text config with what transformers' Llama4TextConfig supplies where config.json
    is silent: its defaults, a NoPE layer every `no_rope_layer_interval` layers, a sparse layer
    every `interleave_moe_layer_step` layers, and the rotary layers chunked where
    `attention_chunk_size` is set."""
    cfg = {
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "num_experts_per_tok": 1,
        "num_local_experts": 16,
        "interleave_moe_layer_step": 1,
        "use_qk_norm": True,
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "attention_bias": False,
        **cfg,
    }
    num_layers = cfg["num_hidden_layers"]
    if not cfg.get("no_rope_layers"):  # 1: the layer rotates, 0: a NoPE layer
        interval = cfg["no_rope_layer_interval"]
        cfg["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(cfg["no_rope_layers"]) < num_layers:
        raise UnsupportedModelError(
            f"config.json field 'no_rope_layers' names {len(cfg['no_rope_layers'])} layers, "
            f"num_hidden_layers is {num_layers}"
        )
    if cfg.get("moe_layers") is None:
        step = cfg["interleave_moe_layer_step"]
        cfg["moe_layers"] = list(range(step - 1, num_layers, step))
    if cfg.get("layer_types") is None:
        chunked = cfg.get("attention_chunk_size") is not None
        cfg["layer_types"] = [
            "chunked_attention" if rope and chunked else "full_attention"
            for rope in cfg["no_rope_layers"][:num_layers]
        ]
    return cfg


def _llama4_attention(cfg: dict) -> Llama4Attention:
    return Llama4Attention(
        rope_layers=tuple(bool(r) for r in cfg["no_rope_layers"][: cfg["num_hidden_layers"]]),
        qk_l2_norm=bool(cfg["use_qk_norm"]),
        temperature_tuning=bool(cfg["attn_temperature_tuning"]),
        floor_scale=float(cfg["floor_scale"]),
        attn_scale=float(cfg["attn_scale"]),
    )


# transformers' names of the attention layer kinds in `layer_types`.
LAYER_TYPES = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
}


def _layer_kinds(model_type: str, cfg: dict) -> tuple[str, ...]:
    """Each layer's kind as the KV cache sees it ("full", "sliding W", "chunked C"), from the
    config's `layer_types` or, where a config has none, as transformers derives them (every
    layer of Mistral and Mixtral sliding; Qwen2's and Qwen3's from `max_window_layers` on, with
    `use_sliding_window`). Empty where every layer is full attention."""
    if model_type in QWEN3_NEXT_MODEL_TYPES:
        return tuple(HYBRID_LAYER_TYPES[name] for name in cfg["layer_types"])
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if not window:
            return ()
        if model_type in ("mistral", "mixtral"):
            types = ["sliding_attention"] * num_layers
        elif cfg.get("use_sliding_window"):
            first = cfg.get("max_window_layers", num_layers)
            types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
        else:
            return ()
    if len(types) != num_layers:
        raise UnsupportedModelError(
            f"config.json field 'layer_types' names {len(types)} layers, "
            f"num_hidden_layers is {num_layers}"
        )
    kinds = []
    for name in types:
        kind = LAYER_TYPES.get(name)
        if kind is None:
            raise UnsupportedModelError(
                f"config.json field 'layer_types' holds {name!r}, which is not supported "
                f"(supported: {', '.join(LAYER_TYPES)})"
            )
        if kind == "sliding":
            if not window:
                raise UnsupportedModelError(
                    "config.json has sliding layers but no 'sliding_window'"
                )
            # A window as long as the context reads every token: full attention.
            kind = (
                "full"
                if window >= cfg.get("max_position_embeddings", window + 1)
                else f"sliding {window}"
            )
        elif kind == "chunked":
            chunk = cfg.get("attention_chunk_size")
            if not chunk:
                raise UnsupportedModelError(
                    "config.json has chunked layers but no 'attention_chunk_size'"
                )
            kind = f"chunked {chunk}"
        kinds.append(kind)
    return tuple(kinds) if any(k != "full" for k in kinds) else ()


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mla_fields(model_type: str, cfg: dict) -> dict:
    """The multi-head latent attention fields of a DeepSeek config ({} for every other family)."""
    if model_type not in DEEPSEEK_MODEL_TYPES:
        return {}
    return {
        "q_lora_rank": cfg.get("q_lora_rank") or 0,
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_nope_head_dim": cfg["qk_nope_head_dim"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"],
        "v_head_dim": cfg["v_head_dim"],
        # transformers rotates V2's pairs as complex numbers: always interleaved.
        "rope_interleave": model_type == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
    }


def _moe_fields(model_type: str, cfg: dict) -> dict:
    """The mixture-of-experts fields of a config, as each family's config names them."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    num_layers = cfg["num_hidden_layers"]
    routing: dict = {}
    if model_type == "mixtral":
        num_experts = cfg.get("num_local_experts", 8)
        width, shared, renormalize = cfg["intermediate_size"], 0, True
        sparse = tuple(range(num_layers))
    elif model_type == "gpt_oss":  # experts in every layer, as wide as intermediate_size
        num_experts = cfg["num_local_experts"]
        width, shared, renormalize = cfg["intermediate_size"], 0, False
        sparse = tuple(range(num_layers))
    elif model_type == "llama4_text":  # a shared expert as wide as each routed one
        num_experts = cfg["num_local_experts"]
        width = shared = cfg["intermediate_size"]
        renormalize = False
        moe_layers = set(cfg["moe_layers"])
        sparse = tuple(i for i in range(num_layers) if num_experts and i in moe_layers)
    elif model_type in DEEPSEEK_MODEL_TYPES:
        num_experts = cfg.get("n_routed_experts") or 0
        width = cfg["moe_intermediate_size"]
        shared = width * (cfg.get("n_shared_experts") or 0)
        renormalize = bool(cfg.get("norm_topk_prob", model_type == "deepseek_v3"))
        first_dense = cfg.get("first_k_dense_replace") or 0
        step = cfg.get("moe_layer_freq", 1) or 1
        sparse = tuple(
            i for i in range(num_layers) if num_experts and i >= first_dense and i % step == 0
        )
        routing = _deepseek_routing(model_type, cfg, num_experts, renormalize)
    else:
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        width = cfg["moe_intermediate_size"]
        gated = model_type in GATED_SHARED_EXPERT_TYPES
        shared = cfg.get("shared_expert_intermediate_size", 0) if gated else 0
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
    if sparse and routing:
        allowed = routing["topk_group"] * (num_experts // routing["n_group"])
        if top_k > allowed:
            raise UnsupportedModelError(
                f"config.json field 'num_experts_per_tok' = {top_k} exceeds the {allowed} "
                f"experts of 'topk_group' = {routing['topk_group']} groups"
            )
    return {
        "num_experts": num_experts if sparse else 0,
        "num_experts_per_tok": top_k if sparse else 0,
        "moe_intermediate_size": width if sparse else 0,
        "shared_expert_intermediate_size": shared if sparse else 0,
        "shared_expert_gated": model_type in GATED_SHARED_EXPERT_TYPES,
        "norm_topk_prob": renormalize,
        "sparse_layers": sparse,
        **(routing if sparse else {}),
    }


def _deepseek_routing(model_type: str, cfg: dict, num_experts: int, renormalize: bool) -> dict:
    """DeepSeek's scoring, expert groups and scaling, checked against what its router can do."""
    v3 = model_type == "deepseek_v3"
    scoring = "sigmoid" if v3 else "softmax"
    if cfg.get("scoring_func", scoring) != scoring:
        raise UnsupportedModelError(
            f"config.json field 'scoring_func' = {cfg['scoring_func']!r} is not supported for "
            f"{model_type} (its router scores with {scoring})"
        )
    if v3 or cfg.get("topk_method", "greedy") == "group_limited_greedy":
        n_group, topk_group = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    elif cfg.get("topk_method", "greedy") == "greedy":
        n_group = topk_group = 1
    else:
        raise UnsupportedModelError(
            f"config.json field 'topk_method' = {cfg['topk_method']!r} is not supported for "
            f"{model_type} (supported: greedy, group_limited_greedy)"
        )
    if not v3 and renormalize:
        raise UnsupportedModelError(
            "config.json field 'norm_topk_prob' = true is not supported for deepseek_v2 "
            "(transformers' DeepSeek-V2 router does not renormalise)"
        )
    if num_experts and (num_experts % n_group or not 1 <= topk_group <= n_group):
        raise UnsupportedModelError(
            f"config.json fields 'n_group' = {n_group} and 'topk_group' = {topk_group} do not "
            f"split {num_experts} experts into groups"
        )
    if v3 and num_experts and num_experts // n_group < 2:
        raise UnsupportedModelError(
            f"config.json field 'n_group' = {n_group} leaves fewer than two experts a group "
            "(DeepSeek-V3 ranks a group by its two best experts)"
        )
    return {
        "scoring_func": scoring,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "score_correction_bias": v3,
    }


# Gemma3TextConfig's defaults in transformers 5.24: the text_config of Gemma 3's multimodal
# checkpoints leaves most fields to them (gemma-3-4b's names neither heads nor head_dim).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,  # the full layers' base
    "rope_local_base_freq": 10_000.0,  # the sliding layers'
    "sliding_window_pattern": 6,  # every 6th layer full, where a config has no layer_types
}
# A multimodal checkpoint's fields that its top level holds for its text model (transformers
# ties the LM head by Gemma3Config's tie_word_embeddings, True by default).
GEMMA3_TOP_LEVEL = ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "quantization_config")
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def _gemma3_text_config(cfg: dict) -> dict:
    """A Gemma 3 config as the other families' read: the text model's (a multimodal checkpoint's
    `text_config`, with what its top level holds for it) over Gemma3TextConfig's defaults, its
    layer types (from `sliding_window_pattern` where a 4.x config has none), and the full layers'
    rope as `rope_theta` / `rope_scaling`; the sliding layers' goes in `local_rope`."""
    model_type = cfg["model_type"]
    if model_type == "gemma3":
        text = dict(cfg.get("text_config") or {})
        text.update({key: cfg[key] for key in GEMMA3_TOP_LEVEL if cfg.get(key) is not None})
        text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
    else:
        text = dict(cfg)
    text = {**GEMMA3_TEXT_DEFAULTS, **text}
    text["model_type"] = model_type
    if text.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(
            f"config.json field 'attn_logit_softcapping' = {text['attn_logit_softcapping']} is "
            "not supported: pdserve's attention kernels have no cap on attention scores"
        )
    if text.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "config.json field 'use_bidirectional_attention' = true is not supported: "
            "pdserve's attention is causal"
        )
    num_layers = text["num_hidden_layers"]
    if text.get("layer_types") is None:
        pattern = text["sliding_window_pattern"]
        text["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    others = set(text["layer_types"]) - {"sliding_attention", "full_attention"}
    if others:
        raise UnsupportedModelError(
            f"config.json field 'layer_types' holds {sorted(others)[0]!r}, which Gemma 3 does "
            "not have (sliding_attention, full_attention)"
        )
    # As Gemma3TextConfig.convert_rope_params_to_dict: 5.x's rope_parameters by layer type, or
    # 4.x's rope_theta with rope_scaling for the full layers, rope_local_base_freq for the others.
    by_type = text.pop("rope_parameters", None) or {}
    full = dict(by_type.get("full_attention") or {"rope_type": "default"})
    full.update(text.pop("rope_scaling", None) or {})
    full.setdefault("rope_theta", text["rope_theta"])
    local = dict(by_type.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", text["rope_local_base_freq"])
    for layer_type, rope in (("full_attention", full), ("sliding_attention", local)):
        # As standardize_rope_params: a legacy `type` only where no rope_type is set.
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        if rope["rope_type"] in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings", text["max_position_embeddings"])
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"config.json field 'rope_parameters.{layer_type}.rope_type' = "
                f"{rope['rope_type']!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
    text["rope_theta"] = full.pop("rope_theta")
    text["rope_scaling"] = full
    text["local_rope"] = local
    # transformers' Gemma 3 reads hidden_activation; 4.x configs carry a hidden_act beside it.
    text.pop("hidden_act", None)
    return text


def _gemma_activation(cfg: dict) -> str:
    """Gemma 3's and Gemma 4's GeGLU activation (`hidden_activation`), refused unless supported."""
    activation = cfg["hidden_activation"]
    if activation not in GEMMA3_ACTIVATIONS:
        raise UnsupportedModelError(
            f"config.json field 'hidden_activation' = {activation!r} is not supported "
            f"(supported: {', '.join(GEMMA3_ACTIVATIONS)})"
        )
    return activation


def _gemma3_fields(model_type: str, cfg: dict) -> dict:
    """Gemma 3's fields of a config made by `_gemma3_text_config` ({} for other families)."""
    if model_type not in GEMMA3_MODEL_TYPES:
        return {}
    activation = _gemma_activation(cfg)
    local = dict(cfg["local_rope"])
    return {
        "mlp_activation": activation,
        "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"]),
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
        "local_rope_layers": tuple(
            i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"
        ),
        "local_rope_theta": float(local.pop("rope_theta")),
        "local_rope_scaling": local,
    }


# Gemma4TextConfig's defaults in transformers 5.24 (and Gemma4Config's placeholder tokens), for
# what a config leaves out; global_head_dim and num_global_key_value_heads are the full layers'
# (the latter only with attention_k_eq_v, as transformers reads it).
GEMMA4_TEXT_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
}
GEMMA4_ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}
GEMMA4_PLACEHOLDERS = {
    "image_token_id": 258_880,
    "video_token_id": 258_884,
    "audio_token_id": 258_881,
}
GEMMA4_ROPE_TYPES = ("default", "proportional")
# What a config's per_layer_config may set per layer: the shape of its keys and values.
GEMMA4_PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def _gemma4_text_config(cfg: dict) -> dict:
    """A Gemma 4 config as the other families' read: the text model's (a multimodal checkpoint's
    `text_config`, with what its top level holds for it) over Gemma4TextConfig's defaults, its
    layer types (the last one full, as transformers forces it), each layer's KV shape (from
    `per_layer_config`, or `global_head_dim` and `num_global_key_value_heads` for the full
    layers), the layer each KV-sharing layer reads, and the rope of each layer type (the full
    layers' as `rope_theta` / `rope_scaling`, the sliding layers' in `local_rope`)."""
    model_type = cfg["model_type"]
    placeholders: tuple[int, ...] = ()
    if model_type == "gemma4":
        text = dict(cfg.get("text_config") or {})
        text.update({key: cfg[key] for key in GEMMA3_TOP_LEVEL if cfg.get(key) is not None})
        text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
        placeholders = tuple(cfg.get(key, default) for key, default in GEMMA4_PLACEHOLDERS.items())
    else:
        text = dict(cfg)
    text = {**GEMMA4_TEXT_DEFAULTS, **text}
    text["model_type"] = model_type
    text["placeholder_ids"] = tuple(p for p in placeholders if p is not None)
    if text.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(
            "config.json field 'use_bidirectional_attention' = 'all' is not supported: "
            "pdserve's attention is causal"
        )
    if text.get("attention_bias"):
        raise UnsupportedModelError(
            "config.json field 'attention_bias' = true is not supported for Gemma 4 "
            "(its releases have none)"
        )
    num_layers = text["num_hidden_layers"]
    types = list(text.get("layer_types") or [])
    if not types:
        types = [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)
        ]
    types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    text["layer_types"] = types
    others = set(types) - {"sliding_attention", "full_attention"}
    if others:
        raise UnsupportedModelError(
            f"config.json field 'layer_types' holds {sorted(others)[0]!r}, which Gemma 4 does "
            "not have (sliding_attention, full_attention)"
        )
    text["layer_shapes"] = shapes = _gemma4_layer_shapes(text, types)
    if len(set(shapes)) == 1:  # every layer alike: the family's usual fields say it
        text["num_key_value_heads"], text["head_dim"] = shapes[0]
    text["kv_donors"] = _gemma4_kv_donors(text, types)
    by_type = {**GEMMA4_ROPE_DEFAULTS, **(text.pop("rope_parameters", None) or {})}
    ropes = {}
    for layer_type in ("full_attention", "sliding_attention"):
        rope = dict(by_type.get(layer_type) or GEMMA4_ROPE_DEFAULTS[layer_type])
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope["rope_type"] not in GEMMA4_ROPE_TYPES:
            raise UnsupportedModelError(
                f"config.json field 'rope_parameters.{layer_type}.rope_type' = "
                f"{rope['rope_type']!r} is not supported "
                f"(supported: {', '.join(GEMMA4_ROPE_TYPES)})"
            )
        ropes[layer_type] = rope
    full = ropes["full_attention"]
    text["rope_theta"] = full.pop("rope_theta")
    text["rope_scaling"] = full
    text["local_rope"] = ropes["sliding_attention"]
    if text.get("enable_moe_block"):
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if not text.get(key):
                raise UnsupportedModelError(f"config.json has enable_moe_block but no '{key}'")
    return text


def _gemma4_layer_shapes(text: dict, types: list[str]) -> list[tuple[int, int]]:
    """Each layer's (KV heads, head_dim): head_dim and num_key_value_heads, overridden by layer
    in `per_layer_config` or, without one, for the full layers by `global_head_dim` and, with
    attention_k_eq_v, `num_global_key_value_heads` (as Gemma4TextConfig makes the overrides)."""
    base = (text["num_key_value_heads"], text["head_dim"])
    overrides = text.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": text["global_head_dim"]}
        if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = text["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == "full_attention"}
    shapes = [base] * len(types)
    for key, fields in overrides.items():
        layer = int(key)
        unknown = sorted(set(fields) - set(GEMMA4_PER_LAYER_FIELDS))
        if unknown:
            raise UnsupportedModelError(
                f"config.json field 'per_layer_config.{key}.{unknown[0]}' is not supported "
                f"(a layer may set {', '.join(GEMMA4_PER_LAYER_FIELDS)})"
            )
        if not 0 <= layer < len(types):
            raise UnsupportedModelError(
                f"config.json field 'per_layer_config' names layer {key} of {len(types)}"
            )
        shapes[layer] = (
            fields.get("num_key_value_heads", base[0]),
            fields.get("head_dim", base[1]),
        )
    return shapes


def _gemma4_kv_donors(text: dict, types: list[str]) -> list[int]:
    """By layer, the layer whose KV it attends over: the last num_kv_shared_layers layers read
    the last earlier layer of their type that keeps its own (Gemma4TextConfig.kv_sharing_modes)."""
    num_layers, shared = len(types), text.get("num_kv_shared_layers") or 0
    first_shared = num_layers - shared
    if shared and first_shared <= 0:
        raise UnsupportedModelError(
            f"config.json field 'num_kv_shared_layers' = {shared} leaves no layer keeping KV"
        )
    donors = list(range(num_layers))
    for layer in range(first_shared, num_layers):
        own = [i for i in range(first_shared) if types[i] == types[layer]]
        if not own:
            raise UnsupportedModelError(
                f"config.json field 'num_kv_shared_layers' = {shared}: layer {layer} "
                f"({types[layer]}) has no earlier layer of its type to read KV from"
            )
        donors[layer] = own[-1]
    shapes = text["layer_shapes"]
    for layer, donor in enumerate(donors):
        if shapes[layer][1] != shapes[donor][1]:
            raise UnsupportedModelError(
                f"config.json: layer {layer} reads layer {donor}'s KV but their head_dim differ"
            )
    return donors


def _gemma4_fields(model_type: str, cfg: dict) -> dict:
    """Gemma 4's fields of a config made by `_gemma4_text_config` ({} for other families)."""
    if model_type not in GEMMA4_MODEL_TYPES:
        return {}
    activation = _gemma_activation(cfg)
    types, donors, shapes = cfg["layer_types"], tuple(cfg["kv_donors"]), cfg["layer_shapes"]
    num_layers = len(types)
    shared = {layer for layer, donor in enumerate(donors) if donor != layer}
    width = cfg["intermediate_size"]
    double = bool(cfg.get("use_double_wide_mlp"))
    mixed = len(set(shapes)) > 1
    moe = bool(cfg.get("enable_moe_block"))
    local = dict(cfg["local_rope"])
    return {
        "mlp_activation": activation,
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
        "local_rope_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        "local_rope_theta": float(local.pop("rope_theta")),
        "local_rope_scaling": local,
        "layer_kv_heads": tuple(h for h, _ in shapes) if mixed else (),
        "layer_head_dims": tuple(d for _, d in shapes) if mixed else (),
        "kv_donors": donors if shared else (),
        "num_experts": cfg["num_experts"] if moe else 0,
        "num_experts_per_tok": cfg["top_k_experts"] if moe else 0,
        "moe_intermediate_size": cfg["moe_intermediate_size"] if moe else 0,
        "norm_topk_prob": moe,
        "sparse_layers": tuple(range(num_layers)) if moe else (),
        "gemma4": Gemma4Text(
            per_layer_input_size=cfg.get("hidden_size_per_layer_input") or 0,
            per_layer_vocab_size=cfg["vocab_size_per_layer_input"],
            k_eq_v_layers=tuple(
                bool(cfg.get("attention_k_eq_v")) and t != "sliding_attention" for t in types
            ),
            mlp_widths=tuple(
                width * 2 if double and i in shared else width for i in range(num_layers)
            ),
            pad_token_id=cfg.get("pad_token_id") or 0,
            placeholder_ids=tuple(cfg["placeholder_ids"]),
        ),
    }


# transformers' names of a hybrid's layer kinds in `layer_types`.
HYBRID_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
# Qwen3NextConfig's, Qwen3_5TextConfig's and Qwen3_5MoeTextConfig's defaults in transformers 5.24,
# for what a config leaves out.
HYBRID_DEFAULTS = {
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
}
HYBRID_TYPE_DEFAULTS = {
    "qwen3_5_text": {
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "qwen3_5_moe_text": {
        "vocab_size": 248320,
        "hidden_size": 2048,
        "intermediate_size": 0,  # every layer's MLP is the experts'
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    "qwen3_next": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    },
}
# What the top level of a multimodal Qwen3.5 checkpoint holds for its text model where its
# text_config does not.
QWEN3_5_TOP_LEVEL = ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "quantization_config")


def _qwen3_5_text_config(cfg: dict) -> dict:
    """The text model's config of a Qwen3_5(Moe)ForConditionalGeneration checkpoint: its
    `text_config`, with the wrapper's dtype, special tokens and quantization where it names none,
    and the wrapper's tie_word_embeddings (the one transformers ties the LM head by)."""
    text = dict(cfg.get("text_config") or {})
    for key in QWEN3_5_TOP_LEVEL:
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    text["model_type"] = QWEN3_5_WRAPPERS[cfg["model_type"]]
    return text


def _qwen3_next_config(cfg: dict) -> dict:
    """A Qwen3-Next or Qwen3.5 (MoE) text config as the other families' read, over
    transformers' defaults: its layer types (every full_attention_interval-th layer full where
    it names none), the width rotary turns (partial_rotary_factor, in rope_parameters or, in 4.x
    configs, at the top level; Qwen3.5's mrope sections turn text positions as plain rope), and
    refusals of what the engine does not run as transformers does."""
    model_type = cfg["model_type"]
    text = {**HYBRID_DEFAULTS, **HYBRID_TYPE_DEFAULTS[model_type], **cfg}
    num_layers = text["num_hidden_layers"]
    if text.get("layer_types") is None:
        interval = text["full_attention_interval"]
        if not isinstance(interval, int) or interval < 1:
            raise UnsupportedModelError(
                f"config.json field 'full_attention_interval' = {interval!r} is not a positive "
                "integer"
            )
        text["layer_types"] = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(num_layers)
        ]
    types = text["layer_types"]
    if len(types) != num_layers:
        raise UnsupportedModelError(
            f"config.json field 'layer_types' names {len(types)} layers, "
            f"num_hidden_layers is {num_layers}"
        )
    for name in types:
        if name not in HYBRID_LAYER_TYPES:
            raise UnsupportedModelError(
                f"config.json field 'layer_types' holds {name!r}, which {model_type} does not "
                f"have (supported: {', '.join(HYBRID_LAYER_TYPES)})"
            )
    if text.get("attn_output_gate") is False:
        raise UnsupportedModelError(
            "config.json field 'attn_output_gate' = false is not supported: transformers' "
            f"{model_type} always gates its attention's output"
        )
    k_heads, v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    if k_heads < 1 or v_heads % k_heads:
        raise UnsupportedModelError(
            f"config.json field 'linear_num_value_heads' = {v_heads} is not a multiple of "
            f"'linear_num_key_heads' = {k_heads}"
        )
    rope = text.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    head_dim = text["head_dim"]
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedModelError(
            f"config.json field 'partial_rotary_factor' = {factor} turns {rotary_dim} of "
            f"head_dim {head_dim} dimensions: it must turn an even number, at least two"
        )
    text["rotary_dim"] = rotary_dim
    if model_type == "qwen3_5_moe_text":
        # transformers' Qwen3.5-MoE makes every layer sparse and renormalises the top k.
        if text.get("mlp_only_layers"):
            raise UnsupportedModelError(
                "config.json field 'mlp_only_layers' is not supported for qwen3_5_moe "
                "(transformers' Qwen3.5-MoE has experts in every layer)"
            )
        if text.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError(
                f"config.json field 'decoder_sparse_step' = {text['decoder_sparse_step']} is not "
                "supported for qwen3_5_moe (transformers' Qwen3.5-MoE has experts in every layer)"
            )
        if text.get("norm_topk_prob") is False:
            raise UnsupportedModelError(
                "config.json field 'norm_topk_prob' = false is not supported for qwen3_5_moe "
                "(transformers' Qwen3.5-MoE router always renormalises)"
            )
        text["norm_topk_prob"] = True
    return text


def _qwen3_next_fields(model_type: str, cfg: dict) -> dict:
    """The hybrids' fields of a config made by `_qwen3_next_config` ({} for other families)."""
    if model_type not in QWEN3_NEXT_MODEL_TYPES:
        return {}
    return {
        "linear_attention": LinearAttention(
            num_k_heads=cfg["linear_num_key_heads"],
            num_v_heads=cfg["linear_num_value_heads"],
            head_k_dim=cfg["linear_key_head_dim"],
            head_v_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg["linear_conv_kernel_dim"],
        ),
        "rotary_dim": cfg["rotary_dim"],
    }
