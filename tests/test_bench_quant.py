"""bench.quant, short: the bf16 model and its FP8 copy side by side; the FP8 engine holds the
quantized projections in one byte per weight plus a float32 scale per 128x128 block, so its
weight bytes are what that arithmetic says, and the table renders a row per model."""

from __future__ import annotations

import json

from pdserve.bench.peers import models as bench_models
from pdserve.bench.quant import docs_table, main


def test_a_short_run_measures_bytes_and_throughput_of_both(tmp_path):
    out = tmp_path / "quant.json"
    argv = ["--requests", "2", "--max-tokens", "4", "--rounds", "1", "--json-out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    cfg = bench_models.config_of("llama-9m")
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = [(heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden),
              (hidden, heads * head_dim), (inter, hidden), (inter, hidden), (hidden, inter)]  # fmt: skip
    linear = layers * sum(o * i for o, i in shapes)
    scales = layers * sum(-(-o // 128) * -(-i // 128) for o, i in shapes)
    # bf16 spends 2 bytes per projection weight, FP8 1 plus 4 per block scale; the rest is equal.
    saved = 2 * linear - (linear + 4 * scales)
    assert res["weight_bytes"]["bf16"] - res["weight_bytes"]["fp8"] == saved
    assert res["rounds"][0]["fp8"]["tokens"] == res["rounds"][0]["bf16"]["tokens"] == 8
    assert "| llama-9m |" in docs_table(res)


def test_a_w4a16_run_holds_half_a_byte_a_weight_plus_float32_group_scales(tmp_path):
    out = tmp_path / "quant.json"
    argv = ["--format", "ct-w4a16", "--requests", "2", "--max-tokens", "4", "--rounds", "1",
            "--json-out", str(out)]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    cfg = bench_models.config_of("llama-9m")
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = [(heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden),
              (hidden, heads * head_dim), (inter, hidden), (inter, hidden), (hidden, inter)]  # fmt: skip
    linear = layers * sum(o * i for o, i in shapes)
    scales = layers * sum(o * (i // 128) for o, i in shapes)
    # bf16 spends 2 bytes per projection weight, W4A16 half a byte plus 4 per group of 128.
    saved = 2 * linear - (linear // 2 + 4 * scales)
    assert res["weight_bytes"]["bf16"] - res["weight_bytes"]["ct-w4a16"] == saved
    assert res["rounds"][0]["ct-w4a16"]["tokens"] == 8
    assert "| llama-9m |" in docs_table(res) and "weights W4A16" in docs_table(res)


def test_a_short_gptq_run_keeps_half_a_byte_per_weight_plus_group_scales(tmp_path):
    out = tmp_path / "quant.json"
    argv = ["--format", "gptq", "--requests", "2", "--max-tokens", "4", "--rounds", "1"]
    assert main([*argv, "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    cfg = bench_models.config_of("llama-9m")
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q, k = heads * head_dim, kv * head_dim
    # (outputs, inputs, fused parts) of qkv, o, gate_up and down.
    layer_shapes = [(q + 2 * k, hidden, 3), (hidden, q, 1), (2 * inter, hidden, 2),
                    (hidden, inter, 1)]  # fmt: skip
    linear = layers * sum(o * i for o, i, _ in layer_shapes)
    groups = layers * sum(o * i // 128 for o, i, _ in layer_shapes)
    g_idx = layers * sum(i * parts for _, i, parts in layer_shapes)
    # bf16 spends 2 bytes per weight; GPTQ half a byte, plus per group of 128 inputs and output
    # a float16 scale and a 4-bit zero point, plus an int32 group index per input and part.
    packed = linear // 2 + groups * 2 + groups // 2 + 4 * g_idx
    assert res["weight_bytes"]["bf16"] - res["weight_bytes"]["gptq"] == 2 * linear - packed
    assert res["rounds"][0]["gptq"]["tokens"] == res["rounds"][0]["bf16"]["tokens"] == 8
    assert "| llama-9m |" in docs_table(res) and "weights GPTQ" in docs_table(res)
