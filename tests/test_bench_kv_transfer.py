"""The KV transfer benchmark's latent-vs-GQA comparison: bytes per token are the layouts' closed
form, a pair too large for the host is measured at the longest prompt that fits (and says so),
both layouts of a pair are timed in the same rounds, and nothing is written unless asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench import kv_transfer as bench
from pdserve.engine.kv_cache import KVLayout

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
    assert "| latent | MLA | 3 | 1 x 1 x 24 (latent) | 144 |" in out

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


def test_the_docs_table_is_the_saved_run():
    repo = Path(__file__).resolve().parents[1]
    saved = json.loads((repo / "bench/results/kv_transfer_mla.json").read_text())
    doc = (repo / "docs/benchmarks.md").read_text()
    section = doc.split("## KV handoff: latent vs GQA bytes per token")[1].split("\n## ")[0]
    assert saved["commit"] in section and saved["date"] in section
    assert saved["command"].removeprefix("python ") in section
    for row in saved["layouts"]:
        lay = KVLayout.from_dict(row["layout"])
        assert row["bytes_per_token"] == bench.bytes_per_token(lay)
        assert f"| {row['model']} | {row['attention']} | {lay.num_layers} |" in section
        assert f"| {row['bytes_per_token']:,} |" in section
    for row in saved["transfers"]:
        m, g = row["mla"], row["gqa"]
        cells = [row["transport"], row["pattern"], m["model"], f"{m['bytes'] / 2**20:,.0f}"]
        cells += [f"{m['seconds'] * 1e3:,.0f}", g["model"], f"{g['bytes'] / 2**20:,.0f}"]
        cells += [f"{g['seconds'] * 1e3:,.0f}", f"{row['gqa_over_mla_bytes']:.2f}x"]
        cells += [f"{row['gqa_over_mla_time']:.2f}x"]
        assert f"| {' | '.join(cells)} |" in section
