"""pdserve.bench.tp_overhead at TP=2 on the CPU: both ranks run every trial in lockstep, and rank 0
reports each plan handoff both ways and a forward's collectives."""

from __future__ import annotations

import json

from pdserve.bench import tp_overhead


def test_runs_both_ways_and_the_collectives_on_two_ranks(tmp_path):
    out = tmp_path / "tp.json"
    results = tp_overhead.main(["--quick", "--repeats", "5", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (plan,) = results["plans"]
    assert plan["plan"] == "decode-1" and plan["bytes"] > 0
    assert {"shm_us", "gloo_us"} <= set(plan) and results["barrier_us"] > 0
    (forward,) = results["collectives"]
    assert forward["all_reduces"] == 5 and forward["step_us"] > 0
    assert len(forward["runs_us"]) == len(plan["shm_runs_us"]) == len(plan["gloo_runs_us"]) == 5
    assert results["command"].startswith("python -m pdserve.bench.tp_overhead --quick")
    assert results["commit"] and results["load"]["after"]
    assert "| decode, 1 sequence of 512 tokens |" in tp_overhead.plans_table(results)
    assert "| tiny (hidden 128, 2 layers, vocabulary 512) | 1 | 5 | 512 |" in (
        tp_overhead.collectives_table(results)
    )
