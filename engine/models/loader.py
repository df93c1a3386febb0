"""Building a model from a checkpoint directory: config, module, weights, on a device; for a
tensor-parallel rank, that rank's part of each."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.gemma3 import Gemma3ForCausalLM
from pdserve.engine.models.gemma4 import Gemma4ForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.qwen3_next import Qwen3NextForCausalLM
from pdserve.engine.models.weights import iter_checkpoint
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard

# The module of each model_type that is not LlamaForCausalLM's.
FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "gemma3_text": Gemma3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gemma4_text": Gemma4ForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_text": Qwen3NextForCausalLM,  # a multimodal qwen3_5's config reads as this
    "qwen3_5_moe_text": Qwen3NextForCausalLM,
}


def build_model(
    cfg: ModelConfig,
    dtype: str,
    device: str,
    shard: TPShard | None = None,
    group: TPGroup | None = None,
) -> LlamaForCausalLM:
    """The module (or a rank's part of it) on `device` in `dtype` with uninitialised weights
    (the rotary table in float32), ready for `load_weights` or, in benchmarks, random values."""
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = FAMILIES.get(cfg.model_type, LlamaForCausalLM)(cfg, shard, group)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.to(torch_dtype)
    model.float32_router_biases()
    model.make_tables(device)
    return model.eval()


def load_model(
    model_dir: str | Path,
    dtype: str,
    device: str,
    shard: TPShard | None = None,
    group: TPGroup | None = None,
) -> LlamaForCausalLM:
    model = build_model(ModelConfig.from_pretrained(model_dir), dtype, device, shard, group)
    model.load_weights(iter_checkpoint(model_dir, getattr(torch, dtype)))
    return model
