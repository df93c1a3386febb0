"""The checkpoints pdserve and its peers are compared on: random-weight Llama, Qwen3, Mixtral and
Qwen3.5 (Gated DeltaNet hybrid) models built with `transformers` (no model hub), with the
pdserve-tiny tokenizer files, written once into the cache folder. Random weights cost what trained ones do; prompts are token ids, so the
tokenizer is only ever loaded. Every head_dim is at least 32 (vLLM's CPU attention refuses 16)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pdserve import cache_root
from pdserve.engine.embedded.tiny import ensure_tiny_model

VERSION = "1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_COMMON = dict(
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    initializer_range=0.02,
)
MODELS: dict[str, dict] = {
    # 8.9M parameters: 4.2M in the embeddings and lm_head, 4.7M in the layers.
    "llama-9m": dict(
        model_type="llama",
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # 51.6M parameters: offline_throughput's default model.
    "llama-50m": dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    ),
    # Qwen3's shape at small scale: q/k RMSNorm, head_dim above hidden / heads, tied embeddings,
    # 3:1 grouped-query attention; 25.0M parameters.
    "qwen3-25m": dict(
        model_type="qwen3",
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1152,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    # A mixture of experts: Mixtral's shape, 8 experts of 512 and 2 per token; 55.3M parameters,
    # 24.6M of them in the embeddings and lm_head, 28.3M in the experts (7.1M active per token).
    "mixtral-55m": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    # Qwen3.5's shape at small scale (`Qwen3_5TextConfig`): three Gated DeltaNet layers to one
    # gated full-attention layer, 2 KV heads of 128 with a quarter of each turning, linear layers
    # of 4 key and 8 value heads of 64 and a convolution of 4; contexts of 8k tokens. Its pool's
    # blocks are raised to 80 tokens to hold a state (`fitted_block_size` of 16); 37.3M
    # parameters, 8.4M of them in the embeddings and lm_head.
    "qwen3.5-37m": dict(
        model_type="qwen3_5_text",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        full_attention_interval=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=4,
        linear_key_head_dim=64,
        linear_num_value_heads=8,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=False,
    ),
}


def config_of(name: str) -> dict:
    """The transformers config keyword arguments of the named model."""
    if name not in MODELS:
        raise ValueError(f"unknown bench model {name!r}; choose from {', '.join(MODELS)}")
    return _COMMON | MODELS[name]


def num_parameters(cfg: dict) -> int | None:
    """Parameters of a Llama, Qwen3 or Mixtral bench model, counted from its config; None for a
    family it does not count (a wrong count is worse than none)."""
    if cfg.get("model_type") not in ("llama", "qwen3", "mixtral"):
        return None
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if experts:  # every expert and the router (the bench models' MoE is Mixtral's)
        mlp = experts * 3 * h * inter + experts * h
    else:
        mlp = 3 * h * inter
    per_layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
    if cfg.get("model_type") == "qwen3":
        per_layer += 2 * head_dim  # q_norm, k_norm
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return embeddings + cfg["num_hidden_layers"] * per_layer + h


def build(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Writes the named model (float32 safetensors, seeded random weights) into `out_dir`."""
    import torch
    import transformers

    opts = config_of(name)
    model_type = opts.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**opts)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tiny = ensure_tiny_model()
    for file in TOKENIZER_FILES:
        shutil.copy(tiny / file, out_dir / file)
    return out_dir


def ensure(name: str) -> Path:
    """The named model's directory under the cache folder, built on first use (safe when
    processes race to it)."""
    config_of(name)
    target = cache_root() / "bench-models" / f"{name}-v{VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(name, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(model: str) -> Path:
    """A named bench model (built if needed) or a checkpoint directory."""
    if model in MODELS:
        return ensure(model)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model {model!r} is neither a bench model ({', '.join(MODELS)}) "
            "nor a directory with a config.json"
        )
    return path


def checkpoint_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
