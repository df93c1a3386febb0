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
