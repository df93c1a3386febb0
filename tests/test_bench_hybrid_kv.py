"""The hybrid-KV benchmark on tiny shapes: a handoff moves each group's blocks the decode side
reads over tcp (bit for bit), fewer bytes than the same model all full; conversations are
admitted into a pool until it is full, at least as many as `peak_blocks` says; a case too large
for the memory given is moved with fewer KV heads and says so; the three shapes' layer kinds are
those transformers' configs build."""

from __future__ import annotations

import pytest

from pdserve.bench import hybrid_kv as bench
from pdserve.engine.kv.cache import KVLayout

pytestmark = pytest.mark.timeout(120)

BS = 4
TINY = {
    "tiny-sliding": KVLayout(
        4, BS, 2, 8, "bfloat16", layer_kinds=("sliding 8", "full", "sliding 8", "full")
    ),
    "tiny-chunked": KVLayout(
        4, BS, 2, 8, "bfloat16", layer_kinds=("chunked 16", "chunked 16", "chunked 16", "full")
    ),
}


def test_a_short_run_moves_fewer_bytes_hybrid_and_holds_more_conversations(capsys):
    results = bench.run(TINY, [40], 16, "tcp", 1 << 20, 1, 1 << 30, 64 << 10, 40, 8)
    assert set(results) == {"settings", "handoffs", "capacity", "notes"}
    assert results["notes"] == []
    assert [(r["model"], r["tokens"]) for r in results["handoffs"]] == [
        ("tiny-sliding", 40),
        ("tiny-chunked", 40),
    ]
    whole = 40 // BS
    for row in results["handoffs"]:
        h, f = row["hybrid"], row["all_full"]
        assert row["measured_kv_heads"] == row["kv_heads"] == 2
        assert h["bytes"] < f["bytes"] and row["bytes_ratio"] < 1
        assert f["blocks"] == whole and f["bytes"] == whole * f["block_bytes"]
        assert (
            h["bytes"]
            == h["blocks"] * h["block_bytes"]
            == sum(h["blocks_per_group"]) * h["block_bytes"]
        )
        assert h["model_bytes_per_token"] == h["bytes_per_token"] == h["bytes"] / 40
        assert h["prefill_peak_blocks"] <= h["prefill_pool_blocks"]
        for side in (h, f):
            assert len(side["times_s"]) == 1 and side["seconds"] > 0
        assert row["time_ratio"] > 0
    sliding, chunked = results["handoffs"]
    # Full groups every block; a window of 8 from position 40 on: blocks 8 and 9 (33..39).
    assert sliding["hybrid"]["blocks_per_group"] == [whole, 2]
    # Three chunked groups of one layer: their chunk 32..39 is blocks 8 and 9.
    assert chunked["hybrid"]["blocks_per_group"] == [whole, 2, 2, 2]
    for row in results["capacity"]:
        h, f = row["hybrid"], row["all_full"]
        assert h["conversations"] > f["conversations"] > 0
        # Every layer full: each conversation holds what peak_blocks says, no fewer blocks.
        assert f["conversations"] == f["formula_conversations"]
        assert f["blocks_per_conversation"] == f["peak_blocks"] == 48 // BS
        assert h["conversations"] >= h["formula_conversations"]
        assert h["blocks_per_conversation"] <= h["peak_blocks"]
        assert h["conversations"] * h["blocks_per_conversation"] <= h["pool_blocks"]
    out = bench.handoff_table(results) + bench.capacity_table(results)
    assert "| tiny-sliding | 40 | 2 |" in out
    assert bench.notes_list(results) == "Every case was moved at the model's own KV heads."
    assert "2 full, 2 sliding 8; 2 groups of 2" in bench.layouts_table(results)


def test_a_case_too_large_is_moved_with_fewer_heads_and_says_so():
    layout = TINY["tiny-sliding"]
    plans = [
        bench.plan_handoff(layout, 40, 16),
        bench.plan_handoff(bench.all_full(layout), 40, 16),
    ]
    at_one_head = sum(p.pool_blocks * p.layout.bytes_per_block // 2 for p in plans)
    assert bench.fitting_heads(plans, 2 * at_one_head) == 2
    assert bench.fitting_heads(plans, at_one_head) == 1
    assert bench.fitting_heads(plans, at_one_head - 1) == 0
    rows, notes = bench.handoffs({"tiny": layout}, [40], 16, "tcp", 1 << 20, 1, at_one_head)
    (row,) = rows
    assert row["measured_kv_heads"] == 1 and row["kv_heads"] == 2
    h = row["hybrid"]
    assert h["model_bytes_per_token"] == 2 * h["bytes_per_token"]
    assert "moved with 1 KV heads" in notes[0]
    assert "1 of 2" in bench.handoff_table({"handoffs": rows})


def test_the_shapes_layer_kinds_are_those_transformers_builds():
    transformers = pytest.importorskip("transformers")
    names = {
        "full_attention": "full",
        "sliding_attention": "sliding",
        "chunked_attention": "chunked",
    }

    def kinds(types: list[str], size: int) -> tuple[str, ...]:
        return tuple(names[t] if t == "full_attention" else f"{names[t]} {size}" for t in types)

    gemma = transformers.Gemma3TextConfig(num_hidden_layers=62, sliding_window=1024)
    assert bench.MODELS["Gemma-3-27B"].layer_kinds == kinds(gemma.layer_types, 1024)
    scout = transformers.Llama4TextConfig(num_hidden_layers=48)
    assert bench.MODELS["Llama-4-Scout"].layer_kinds == kinds(scout.layer_types, 8192)
    oss = transformers.GptOssConfig(num_hidden_layers=24, sliding_window=128)
    assert bench.MODELS["gpt-oss-20b"].layer_kinds == kinds(oss.layer_types, 128)
    assert "10 full, 52 sliding 1024; 7 groups: 6 of 10, 1 of 2" == bench.layer_summary(
        bench.MODELS["Gemma-3-27B"]
    )
