"""Building a model from a checkpoint directory: config, module, weights, on a device."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.weights import iter_weights


def load_model(model_dir: str | Path, dtype: str, device: str) -> LlamaForCausalLM:
    cfg = ModelConfig.from_pretrained(model_dir)
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device)
    model.cos_sin = LlamaForCausalLM._rotary_table(cfg).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.to(torch_dtype)
    model.cos_sin = model.cos_sin.float()
    model.load_weights(iter_weights(model_dir, torch_dtype))
    return model.eval()
