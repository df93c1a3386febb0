"""The KV transfer benchmark's latent-vs-GQA comparison: bytes per token are the layouts' closed
form, a pair too large for the host is measured at the longest prompt that fits (and says so),
both layouts of a pair are timed in the same rounds, and nothing is written unless asked."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import kv_transfer as bench
from pdserve.engine.kv.cache import KVLayout

pytestmark = pytest.mark.timeout(120)


def test_bytes_per_token_is_layers_times_planes_heads_width_and_two_bytes():
    layouts = {}
    for mla_name, mla, gqa_name, gqa in bench.MLA_PAIRS:
        layouts[mla_name], layouts[gqa_name] = mla, gqa
    for lay in layouts.values():
        closed = lay.num_layers * lay.planes * lay.num_kv_heads * lay.head_dim * 2  # bf16
        assert bench.bytes_per_token(lay) == closed
        assert lay.dtype == "bfloat16" and lay.block_size == 16
    assert bench.bytes_per_token(layouts["DeepSeek-V3"]) == 61 * 576 * 2 == 70_272
    assert bench.bytes_per_token(layouts["Llama-3.1-405B"]) == 126 * 2 * 8 * 128 * 2 == 516_096
    assert bench.bytes_per_token(layouts["DeepSeek-V2-Lite"]) == 27 * 576 * 2 == 31_104
    assert bench.bytes_per_token(layouts["Qwen2.5-14B"]) == 48 * 2 * 8 * 128 * 2 == 196_608


def test_a_pair_too_large_for_the_memory_is_measured_at_the_longest_prompt_that_fits():
    _, mla, _, gqa = bench.MLA_PAIRS[0]
    per_token = 2 * (bench.bytes_per_token(mla) + bench.bytes_per_token(gqa))
    assert bench.fitting_tokens([mla, gqa], 8192, 8192 * per_token) == 8192
    assert bench.fitting_tokens([mla, gqa], 8192, 100 << 30) == 8192  # never more than asked
    short = bench.fitting_tokens([mla, gqa], 8192, 3000 * per_token)
    assert short == 2992 and short % 16 == 0  # whole blocks
    assert bench.fitting_tokens([mla, gqa], 8192, per_token) == 0


def tiny_pairs() -> tuple[tuple[str, KVLayout, str, KVLayout], ...]:
    return (
        (
            "latent",
            KVLayout(3, 16, 1, 24, "bfloat16", planes=1),
            "gqa",
            KVLayout(4, 16, 2, 8, "bfloat16"),
        ),
    )


def test_both_layouts_of_a_pair_move_over_tcp_and_shm_in_the_same_rounds(capsys):
    results = bench.mla_compare(
        ["tcp", "shm"], 64, ["contiguous", "random"], 2, 1 << 20, tiny_pairs()
    )
    assert [r["model"] for r in results["layouts"]] == ["latent", "gqa"]
    assert [(r["transport"], r["pattern"]) for r in results["transfers"]] == [
        ("tcp", "contiguous"),
        ("tcp", "random"),
        ("shm", "contiguous"),
        ("shm", "random"),
    ]
    for row in results["transfers"]:
        assert row["tokens"] == 64
        assert (
            row["mla"]["bytes"] == 64 * 3 * 24 * 2 and row["gqa"]["bytes"] == 64 * 4 * 2 * 2 * 8 * 2
        )
        assert len(row["mla"]["times_s"]) == len(row["gqa"]["times_s"]) == 2
        assert row["gqa_over_mla_bytes"] == pytest.approx(256 / 144)
        assert row["gqa_over_mla_time"] > 0
    assert results["shortened"] == []
    out = capsys.readouterr().out
    assert "| latent | MLA | 3 | 1 × 1 × 24 (latent) | 144 |" in out

    short = bench.mla_compare(["tcp"], 64, ["contiguous"], 1, 1 << 20, tiny_pairs(), budget=20_000)
    assert short["transfers"][0]["tokens"] == 16
    assert (
        "64 tokens need" in short["shortened"][0]
        and "measured at 16 tokens" in short["shortened"][0]
    )


def test_the_command_writes_its_results_only_where_told(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["--mla-compare", "--tokens", "32", "--repeats", "1", "--transports", "tcp"]
    argv += ["--patterns", "contiguous"]
    bench.main(argv)
    assert list(tmp_path.iterdir()) == []
    assert "DeepSeek-V3" in capsys.readouterr().out
    out = tmp_path / "results" / "mla.json"
    out.parent.mkdir()
    bench.main([*argv, "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["command"].endswith(" ".join([*argv, "--out", str(out)]))
    assert saved["commit"] and saved["date"] and saved["machine"]["cores"]
    assert saved["not_measured"]["shm"] == "not asked (--transports)"
    assert {r["model"] for r in saved["layouts"]} == {
        "DeepSeek-V3",
        "Llama-3.1-405B",
        "DeepSeek-V2-Lite",
        "Qwen2.5-14B",
    }
    assert [(r["mla"]["model"], r["tokens"]) for r in saved["transfers"]] == [
        ("DeepSeek-V3", 32),
        ("DeepSeek-V2-Lite", 32),
    ]


def test_the_sweep_records_its_run_every_round_and_prints_the_docs_table(tmp_path, capsys):
    out = tmp_path / "security.json"
    argv = ["--transports", "tcp", "--blocks", "1", "--repeats", "2", "--patterns", "contiguous"]
    bench.main([*argv, "--security", "none", "curve", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python -m pdserve.bench.kv_transfer --transports tcp")
    assert saved["commit"] and saved["date"] and saved["load"]["before"] and saved["load"]["after"]
    assert saved["machine"]["cores"] and "cpu_flags" in saved["machine"]
    rows = saved["rows"]
    assert [r["security"] for r in rows] == ["none", "curve"]
    assert all(len(r["times_s"]) == len(r["raw_times_s"]) == 2 for r in rows)
    table = bench.security_table(saved)
    assert table in capsys.readouterr().out
    assert "| tcp | 1 | contiguous | 2 |" in table and "curve / none" in table
    assert "of their unencrypted rate" in bench.security_summary(saved)


def test_integrity_table_puts_each_point_with_and_without_the_digest_on_one_line():
    def row(integrity: bool, gbs: float, vs: float) -> dict:
        return {
            "transport": "shm",
            "security": "none",
            "integrity": integrity,
            "pattern": "random",
            "blocks": 16,
            "MiB": 32.0,
            "GB/s": gbs,
            "vs none, integrity on": vs,
        }

    table = bench.integrity_table({"rows": [row(True, 3.8, 1.0), row(False, 6.29, 1.67)]})
    assert table.split("\n")[-1] == "| shm | 16 | random | 32 | 3.80 | 6.29 | 167% |"


def test_a_windowed_checkpoints_layout_moves_a_page_per_slot_of_its_largest_group(
    checkpoint_dir, tmp_path
):
    # qwen2_sliding: three layers in three KV groups of one, so a block holds one slot's pages.
    model = checkpoint_dir("qwen2_sliding")
    layout = bench.model_layout(str(model), "bfloat16")
    assert layout.layer_kinds == ("full", "sliding 12", "sliding 12") and layout.num_slots == 1
    assert bench.model_layout(str(model / "config.json"), "bfloat16") == layout
    out = tmp_path / "windowed.json"
    argv = ["--model", str(model), "--transports", "tcp", "--blocks", "4", "--repeats", "1"]
    bench.main([*argv, "--patterns", "contiguous", "--json", str(out)])
    results = json.loads(out.read_text())
    assert KVLayout.from_dict(results["settings"]["layout"]) == layout
    (row, *_) = results["rows"]
    assert row["MiB"] * 2**20 == 4 * layout.bytes_per_block == 4 * 2 * 16 * 2 * 16 * 2
    assert row["GB/s"] > 0
