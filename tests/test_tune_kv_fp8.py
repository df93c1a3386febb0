"""`pdserve tune` sizes an FP8 KV cache (`--kv-cache-dtype fp8`) as a node's pool holds it: each
(token, KV head) row head_dim bytes and a float32 scale, MLA's latent one such row; its figures
equal the engine's own `KVLayout` for the same model and engine options."""

from __future__ import annotations

import dataclasses

import pytest
from checkpoints import build_checkpoint

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.models.config import ModelConfig
from pdserve.tune.measure import pool_blocks
from pdserve.tune.model_shape import ModelShape

BLOCK = 16


@pytest.mark.parametrize("family", ["llama", "deepseek_v2", "qwen2_sliding"])
def test_fp8_kv_bytes_are_the_engines_layout(family, tmp_path):
    model_dir = build_checkpoint(family, tmp_path / family)
    shape = ModelShape.from_model_dir(model_dir)
    config = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp8")
    kv_dtype = config.kv_dtype()
    engine = KVLayout.for_model(ModelConfig.from_pretrained(model_dir), BLOCK, kv_dtype)
    assert shape.kv_bytes_per_block(BLOCK, kv_dtype) == engine.bytes_per_block
    # One token of one layer: K and V rows of every KV head, or MLA's one latent row, each a byte
    # a value and a 4-byte scale.
    if shape.is_mla:
        row = shape.kv_lora_rank + shape.head_dim + 4
        assert shape.kv_bytes_per_layer_token(kv_dtype) == row
    else:
        row = shape.head_dim + 4
        assert shape.kv_bytes_per_layer_token(kv_dtype) == 2 * shape.num_kv_heads * row
    if not shape.layer_kinds:  # every layer full: a block is block_size tokens of every layer
        assert shape.kv_bytes_per_token(kv_dtype) * BLOCK == engine.bytes_per_block
    assert shape.kv_bytes_per_token(kv_dtype) < shape.kv_bytes_per_token("bfloat16")
    # The tuner's pool under these engine options: as many FP8 blocks as the bytes allow.
    sized = dataclasses.replace(config, kv_cache_bytes=100 * engine.bytes_per_block)
    assert pool_blocks(sized, shape) == 100
