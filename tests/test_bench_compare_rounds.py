"""`pdserve.bench.compare` in rounds: the systems alternate their order round by round, the
tuned system serves what `pdserve tune` wrote for each workload, every point records where each
process's CPU went, and the rounds' tables, ratios and aim read back from the results file."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import compare
from pdserve.bench.serving import served_rounds


@pytest.mark.cluster
def test_a_run_in_rounds_alternates_systems_serves_the_tuned_config_and_times_the_cpu(tmp_path):
    argv = ["--systems", "colocated", "tuned", "--variants", "short-only", "--rates", "4"]
    argv += ["--duration-s", "1", "--min-requests", "6", "--rounds", "2", "--tune-quick"]
    argv += ["--cpu-samples-hz", "50", "--no-progress", "--work-dir", str(tmp_path)]
    assert compare.main(argv) == 0
    results = json.loads((tmp_path / "serving_compare.json").read_text())
    sweeps = results["sweeps"]
    assert [(s["round"], s["system"]) for s in sweeps] == [
        (1, "colocated"), (1, "tuned"), (2, "tuned"), (2, "colocated"),
    ]  # fmt: skip
    # The tuned system ran from the config file pdserve tune wrote for the workload.
    written = (tmp_path / "tune-short-only" / "pdserve.toml").read_text()
    tuned = next(s for s in sweeps if s["system"] == "tuned")
    assert "--config" in tuned["command"] and "tuned-short-only" in " ".join(tuned["command"])
    assert all(f"{k} =" in written for k in tuned["config"] if k not in compare.NODE_CONFIG)
    for sweep in sweeps:
        (point,) = sweep["points"]
        cpu = point["cpu"]
        assert cpu["tokens"] == point["summary"]["output_tokens"] > 0
        roles = cpu["roles"]
        assert "coordinator" in roles and roles["coordinator"]["cpu_s"] > 0
        nodes = [r for name, r in roles.items() if name != "coordinator"]
        assert nodes and sum(r["cpu_s"] for r in nodes) > 0
        assert sum(sum(r["samples"].values()) for r in roles.values()) > 0  # py-spy sampled
    text = served_rounds.markdown(results)
    assert "Medians over 2 rounds" in text and "CPU ms per token (short-only, 4 req/s)" in text


def _point(goodput: float, tpot_p99: float, rate: float = 2.0) -> dict:
    summary = {"goodput": goodput, "tpot_ms": {"p99": tpot_p99}, "itl_ms": {"p50": 1.5}}
    return {"config": {"rate": rate}, "summary": summary}


def _results(tuned: list[float], vllm: list[float], tpot=(10.0, 20.0)) -> dict:
    sweeps = []
    for rnd, (a, b) in enumerate(zip(tuned, vllm), 1):
        sweeps.append(
            {"system": "tuned", "variant": "mixed", "round": rnd, "points": [_point(a, tpot[0])]}
        )
        sweeps.append(
            {"system": "vllm", "variant": "mixed", "round": rnd, "points": [_point(b, tpot[1])]}
        )
    return {"sweeps": sweeps}


def test_ratios_pair_rounds_and_the_aim_needs_the_median_lead_above_the_spread():
    r = _results([2.4, 2.6, 1.5], [2.0, 2.0, 1.6])
    assert served_rounds.ratios(r, "tuned", "vllm", "mixed", 2.0) == pytest.approx(
        [1.2, 1.3, 1.5 / 1.6]
    )
    # Median 1.2x, but one round below 1x: missed.
    assert served_rounds.aim_lines(r)[0].endswith("**missed**")
    r = _results([2.4, 2.6, 2.5], [2.0, 2.0, 2.0])
    assert served_rounds.aim_lines(r)[0].endswith("**met**")
    # The same lead with a worse P99 TPOT than the peer's: missed.
    r = _results([2.4, 2.6, 2.5], [2.0, 2.0, 2.0], tpot=(30.0, 20.0))
    assert served_rounds.aim_lines(r)[0].endswith("**missed**")
    assert "met at 0 of 1 points" in served_rounds.docs_aim(r)
    table = served_rounds.docs_rounds(_results([2.4, 2.6, 2.5], [2.0, 2.2, 2.0]))
    assert (
        "| mixed | 2 | 2.50 (2.40–2.60) | 2.00 (2.00–2.20) | 1.20x (1.18–1.25) | 10.0 / 20.0 |"
        in table
    )


def test_the_cpu_table_pools_rounds_as_a_ratio_of_sums():
    def cpu(tokens: int, cpu_s: float, samples: dict) -> dict:
        roles = {"coordinator": {"cpu_s": cpu_s, "zmq_s": 0.0, "samples": samples}}
        return {"tokens": tokens, "roles": roles}

    r = _results([2.0, 2.0], [2.0, 2.0])
    tuned = [s for s in r["sweeps"] if s["system"] == "tuned"]
    tuned[0]["points"][0]["cpu"] = cpu(1000, 1.0, {"HTTP and SSE": 3})
    tuned[1]["points"][0]["cpu"] = cpu(3000, 1.0, {"HTTP and SSE": 1})
    table = served_rounds.docs_cpu(r)
    # 2 s over 4000 tokens: 0.5 ms a token, all of it HTTP.
    assert "| **all of the process** | **0.500** |" in table
    assert "| HTTP and SSE | 0.500 |" in table
