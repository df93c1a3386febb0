"""The decode step on paper (bench/decode_paper.py): its byte, FLOP and launch arithmetic, worked
by hand on a small shape and checked against bench/model_step.py's own byte count."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.bench import decode_paper, model_step
from pdserve.engine.models.config import ModelConfig

# One layer, hidden 8, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 10.
SMALL = ModelConfig.from_dict(
    {
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "vocab_size": 10,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
)


def test_small_shape_bytes_worked_by_hand():
    plan = decode_paper.split_plan(SMALL, 2, 64, torch.bfloat16, 132)
    parts = {p.name: p for p in decode_paper.step_parts(SMALL, 2, 3, 2, plan)}
    # qkv 8x16 + o 8x8 + gate_up 8x32 + down 16x8 = 576; LM head 80; 3 norms of 8; 2 embedding rows.
    assert parts["weights (GEMMs, norms, embedding rows)"].bytes == (576 + 80 + 24 + 16) * 2
    # 2 sequences x 4 tokens x 1 layer x K,V x 4 values x 2 bytes; the store: the new token only.
    assert parts["KV pages read"].bytes == 128
    assert parts["KV store"].bytes == 32
    # QK and PV on a tile padded to 16 query rows (the kernel's BLOCK_G; the group is 2):
    # 2 FLOPs x 2 products x 2 sequences x 1 KV head x 16 rows x 4 dims x 4 tokens.
    assert parts["KV pages read"].flop == 2 * 2 * 2 * 16 * 4 * 4
    # Per token: norms 32, qkv 16, rotary 24, store 8, attention 16, o_proj 16, gate_up 32,
    # silu 32, mul 48, down 24 = 248; the embedding write and final norm's read 16; x2 tokens x2
    # bytes; float32 logits 2 x 10 x 4.
    assert parts["activations and logits"].bytes == (248 + 16) * 2 * 2 + 80
    # GEMM FLOPs: 2 x tokens x (layer + head parameters).
    assert parts["weights (GEMMs, norms, embedding rows)"].flop == 2 * 2 * (576 + 80)


def test_weights_and_kv_equal_model_step_byte_count():
    cfg = model_step.model_config("tiny")
    model = model_step.random_model(cfg, "float32", "cpu", 0)
    pool = model_step.kv_pool(cfg, "float32", 4, "cpu")
    plan = decode_paper.split_plan(cfg, 5, cfg.max_position_embeddings, torch.float32, 132)
    parts = decode_paper.step_parts(cfg, 5, 100, 4, plan)
    assert decode_paper.model_step_bytes(parts) == model_step.decode_bytes(model, pool, 5, 100)


def test_split_plan_of_the_llama3_8b_graph():
    cfg = model_step.model_config("llama3-8b")
    wide = decode_paper.split_plan(cfg, 256, 8192, torch.bfloat16, 132)
    # 256 x 8 KV heads = 2048 programs fill 132 SMs x 4 at one split: no partials.
    assert (wide.splits, wide.programs, wide.partial_bytes) == (1, 2048, 0)
    assert wide.programs_per_sm == pytest.approx(2048 / 132)
    one = decode_paper.split_plan(cfg, 1, 8192, torch.bfloat16, 132)
    # 8 programs want cdiv(528, 8) = 66 splits, capped at 8192 / 128 = 64 of 128 tokens.
    assert (one.splits, one.partition) == (64, 128)
    # [1, 32 heads, 64 splits, 128 + 1] float32, written and read, in 32 layers.
    assert one.partial_bytes == 2 * 32 * 64 * 129 * 4 * 32
    assert decode_paper.step_launches(cfg, one) == decode_paper.step_launches(cfg, wide) + 32


def test_launch_cost_is_the_batch_one_time_beyond_its_bytes(tmp_path):
    cfg = model_step.model_config("tiny")
    plan = decode_paper.split_plan(cfg, 1, cfg.max_position_embeddings, torch.bfloat16, 132)
    moved = sum(p.bytes for p in decode_paper.step_parts(cfg, 1, 512, 2, plan))
    launches = decode_paper.step_launches(cfg, plan)
    copy_gbps = 1000.0
    graph_ms = (moved / (copy_gbps * 1e9) + launches * 5e-6) * 1e3
    rows = [{"batch": 1, "context": 512, "graph_ms": graph_ms}]
    rows.append({"batch": 1, "context": 4096, "graph_ms": 99.0})
    data = {"copy_gbps": copy_gbps, "decode": rows}
    assert decode_paper.launch_cost_s(cfg, data, 2, 132) == pytest.approx(5e-6)


def test_report_on_the_recorded_h200_run_says_it_is_arithmetic():
    text = decode_paper.main(["--batch", "256", "--context", "512"])
    assert "arithmetic, not a measurement" in text
    data = json.loads(decode_paper.DEFAULT_RESULTS.read_text())
    step = next(s for s in data["steps"] if s["name"] == "model_step")["data"]
    row = next(r for r in step["decode"] if (r["batch"], r["context"]) == (256, 512))
    assert f"measured graph step: {row['graph_ms']:.3f} ms" in text


def test_docs_table_is_the_reports_table():
    data = json.loads(decode_paper.DEFAULT_RESULTS.read_text())
    table = decode_paper.docs_table(data, batch="64", context="4096")
    assert table in decode_paper.main(["--batch", "64", "--context", "4096"])
    assert table.count("\n") == 6  # header, rule, five parts
