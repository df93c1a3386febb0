"""bench.kv_fp8, short: the embedded model with an FP8 cache against its float32 cache; the bytes
per token are what the page format says (2 x KV heads x (head_dim + 4) per layer), the shares
are shares, and the log-probability gap is measured where the runs share their context."""

from __future__ import annotations

import json

from pdserve.bench.kv_fp8 import logprob_gaps, main


def test_a_short_run_measures_agreement_and_bytes(tmp_path):
    out = tmp_path / "kv_fp8.json"
    argv = ["--prompts", "4", "--max-tokens", "4", "--json-out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    sizes = res["kv_bytes_per_token"]
    layers, heads, head_dim = 4, 2, 32  # pdserve-stories
    assert sizes["fp8"]["per_layer"] == 2 * heads * (head_dim + 4)
    assert sizes["bfloat16"]["per_layer"] == 2 * heads * head_dim * 2
    assert sizes["fp8"]["all_layers"] == layers * sizes["fp8"]["per_layer"]
    assert res["fp8_over_bf16_bytes"] == (head_dim + 4) / (2 * head_dim)
    assert res["reference_kv_dtype"] == "float32" and res["command"].endswith(" ".join(argv))
    for share in ("tokens_equal_share", "first_tokens_equal_share", "outputs_equal_share"):
        assert 0 <= res[share] <= 1
    assert res["logprob_positions"] >= 4  # each prompt's first token at least
    assert res["mean_logprob_gap"] >= 0


def test_the_gap_stops_after_the_first_token_where_the_runs_part():
    ref = [{"token": (5, -0.5), "top": [(5, -0.5)]}, {"token": (6, -1.0), "top": [(6, -1.0)]}]
    fp8 = [
        {"token": (5, -0.75), "top": [(5, -0.75)]},
        {"token": (7, -0.5), "top": [(7, -0.5), (6, -2.0)]},
        {"token": (8, -0.1), "top": [(8, -0.1)]},
    ]
    assert logprob_gaps(ref, fp8, [5, 6, 9], [5, 7, 8]) == [0.25, 1.0]
