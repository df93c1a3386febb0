"""The hybrid-KV benchmark on tiny shapes: a handoff moves each group's blocks the decode side
reads over tcp (bit for bit), fewer bytes than the same model all full; conversations are
admitted into a pool until it is full, at least as many as `peak_blocks` says; a case too large
for the memory given is moved with fewer KV heads and says so; a linear hybrid moves one block
per linear group, its linear heads shrunk with the KV heads, and keeps as many bytes per cached
token as the dense model; the shapes are those transformers' configs build."""

from __future__ import annotations

import pytest

from pdserve.bench import hybrid_kv as bench
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.state_pages import fitted_block_size
from pdserve.engine.models.config import LinearAttention

pytestmark = pytest.mark.timeout(120)

BS = 4
SLIDING = KVLayout(4, BS, 2, 8, "bfloat16", layer_kinds=("sliding 8", "full", "sliding 8", "full"))
CHUNKED = KVLayout(
    4, BS, 2, 8, "bfloat16", layer_kinds=("chunked 16", "chunked 16", "chunked 16", "full")
)
TINY = {
    "tiny-sliding": bench.Case.of_attention(SLIDING),
    "tiny-chunked": bench.Case.of_attention(CHUNKED),
}
# Eight layers, three Gated DeltaNet layers to one attention layer, as Qwen3.5's; a state of 180
# elements a pool head takes a page of 12 tokens (2 planes of 8).
TINY_LINEAR = bench.Case.of_linear(
    bench.gated_deltanet_hybrid(
        "qwen3_5_text", 8, 16, 4, 2, 10, 32, LinearAttention(2, 4, 8, 6, 4), head_dim=8
    ),
    block_size=BS,
)


def test_a_short_run_moves_fewer_bytes_hybrid_and_holds_more_conversations(capsys):
    results = bench.run(TINY, [40], 16, "tcp", 1 << 20, 1, 1 << 30, 64 << 10, 40, 8)
    assert set(results) == {"settings", "cases", "handoffs", "capacity", "notes"}
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
    layout = SLIDING
    plans = [
        bench.plan_handoff(layout, 40, 16),
        bench.plan_handoff(bench.all_full(layout), 40, 16),
    ]
    at_one_head = sum(p.pool_blocks * p.layout.bytes_per_block // 2 for p in plans)
    assert bench.fitting_heads(plans, 2 * at_one_head) == 2
    assert bench.fitting_heads(plans, at_one_head) == 1
    assert bench.fitting_heads(plans, at_one_head - 1) == 0
    rows, notes = bench.handoffs(
        {"tiny": TINY["tiny-sliding"]}, [40], 16, "tcp", 1 << 20, 1, at_one_head
    )
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
    assert bench.MODELS["Gemma-3-27B"].hybrid.layer_kinds == kinds(gemma.layer_types, 1024)
    scout = transformers.Llama4TextConfig(num_hidden_layers=48)
    assert bench.MODELS["Llama-4-Scout"].hybrid.layer_kinds == kinds(scout.layer_types, 8192)
    oss = transformers.GptOssConfig(num_hidden_layers=24, sliding_window=128)
    assert bench.MODELS["gpt-oss-20b"].hybrid.layer_kinds == kinds(oss.layer_types, 128)
    assert "10 full, 52 sliding 1024; 7 groups: 6 of 10, 1 of 2" == bench.layer_summary(
        bench.MODELS["Gemma-3-27B"].hybrid
    )


def test_a_linear_hybrid_moves_one_state_block_per_linear_group_and_fewer_bytes():
    case = TINY_LINEAR
    assert case.hybrid.block_size == 12 == fitted_block_size(case.linear, BS)
    assert case.all_full.block_size == BS and case.all_full.layer_kinds == ()
    assert (case.all_full.num_layers, case.all_full.num_kv_heads) == (8, 2)
    results = bench.run(
        {"tiny-linear": case}, [40, 100], 16, "tcp", 1 << 20, 1, 1 << 30, 64 << 10, 40, 8
    )
    assert results["notes"] == []
    assert [row["tokens"] for row in results["handoffs"]] == [40, 100]
    for row in results["handoffs"]:
        tokens, h, f = row["tokens"], row["hybrid"], row["all_full"]
        assert row["block_sizes"] == [12, BS]
        # The full group's every block, then one block per linear group: the state after the
        # prompt's last token.
        assert h["blocks_per_group"] == [-(-tokens // 12), 1, 1, 1]
        assert f["blocks"] == tokens // BS
        assert h["bytes"] < f["bytes"] and row["bytes_ratio"] < 1
        # The prefix cache keeps a state per block boundary: as many bytes a cached token as
        # the dense model's KV.
        assert h["cached_blocks"] == 4 * (tokens // 12) and f["cached_blocks"] == tokens // BS
        assert h["model_cached_bytes_per_token"] == f["model_cached_bytes_per_token"]
    summary = results["cases"]["tiny-linear"]
    assert summary["block_size"]["hybrid"] == 12 and summary["block_size"]["all_full"] == BS
    assert "fitted_block_size" in summary["block_size"]["why"]
    assert (
        summary["cached_bytes_per_token"]["hybrid"] == summary["cached_bytes_per_token"]["all_full"]
    )
    assert summary["linear_state_bytes"] == 2 * 180 * 2 <= summary["page_bytes"]
    (capacity,) = results["capacity"]
    assert capacity["hybrid"]["conversations"] > capacity["all_full"]["conversations"] > 0
    table = bench.snapshot_table(results)
    assert "| tiny-linear | 12 / 4 |" in table and "| 1.000 |" in table
    assert "2 full, 6 linear; 4 groups of 2" in bench.layouts_table(results)


def test_a_linear_hybrid_too_large_shrinks_its_linear_heads_with_the_kv_heads():
    case = TINY_LINEAR
    plans = [
        bench.plan_handoff(case.hybrid, 40, 16),
        bench.plan_handoff(case.all_full, 40, 16),
    ]
    at_one_head = sum(p.pool_blocks * p.layout.bytes_per_block // 2 for p in plans)
    state = case.state_at(1)
    assert (state.num_k_heads, state.num_v_heads) == (1, 2)
    assert state.min_block_size() == case.state_at(2).min_block_size() <= 12
    rows, notes = bench.handoffs({"tiny": case}, [40], 16, "tcp", 1 << 20, 1, at_one_head)
    (row,) = rows
    assert row["measured_kv_heads"] == 1 and row["hybrid"]["blocks_per_group"] == [4, 1, 1, 1]
    assert row["hybrid"]["model_bytes_per_token"] == 2 * row["hybrid"]["bytes_per_token"]
    assert "cut alike to 1 key and 2 value heads" in notes[0]
    # Linear heads that do not divide over fewer pool heads: not shrunk.
    assert bench.fitting_heads(plans, at_one_head, lambda heads: heads > 1) == 0


def test_the_linear_hybrids_shapes_are_transformers_config_defaults():
    transformers = pytest.importorskip("transformers")
    names = {"full_attention": "full", "linear_attention": "linear"}
    for model, config in (
        ("Qwen3-Next-80B-A3B", transformers.Qwen3NextConfig()),
        ("Qwen3.5-9B", transformers.Qwen3_5TextConfig()),
    ):
        case = bench.MODELS[model]
        cfg = case.linear
        assert cfg.layer_kinds == tuple(names[t] for t in config.layer_types)
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads) == (
            config.num_hidden_layers,
            config.hidden_size,
            config.num_attention_heads,
        )
        assert (cfg.num_kv_heads, cfg.head_dim) == (config.num_key_value_heads, config.head_dim)
        assert cfg.linear_attention == LinearAttention(
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
        )
        assert case.hybrid.block_size == fitted_block_size(cfg, 16) > 16
        dense = case.all_full
        assert (dense.num_layers, dense.num_kv_heads, dense.head_dim) == (
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
        )
        assert dense.block_size == 16 and dense.layer_kinds == ()
        assert case.tokens == (2048, 8192, 32768)
    assert bench.MODELS["Qwen3-Next-80B-A3B"].hybrid.block_size == 544
    assert bench.MODELS["Qwen3.5-9B"].hybrid.block_size == 272
