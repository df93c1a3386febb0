"""bench/moe.py on CPU: a row per token count, the experts the tokens touched within what routing
allows, and its active FLOPs those torch counts in a dense MLP of the same active width and the
router."""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from pdserve.bench import moe as bench


def test_the_moe_bench_counts_the_active_flops_of_each_token_count(tmp_path):
    out = tmp_path / "moe.json"
    result = bench.main(
        ["--device", "cpu", "--tokens", "1,8", "--repeats", "1", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == result
    shape = result["shape"]
    moe, dense = bench.layer(tuple(shape.values()), "cpu", torch.float32, seed=0)
    for row, n in zip(result["rows"], (1, 8), strict=True):
        assert row["tokens"] == n
        assert shape["top_k"] <= row["experts_touched"] <= min(shape["experts"], n * shape["top_k"])
        assert set(row["moe_ms"]) <= {"torch", "onednn"} and row["dense_ms"] > 0
        x = torch.randn(n, shape["hidden"])
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            dense(x)
            moe.gate(x)
        assert row["active_tflop"] * 1e12 == counter.get_total_flops()
