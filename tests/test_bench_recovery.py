"""The recovery benchmark, short: one SIGKILL of a decode node and one of the coordinator under
`pdserve launch`, on real local clusters of pdserve-tiny; the measurement comes out, every
affected request is served again and ends with the offline engine's tokens, and no process is
left behind. Its verdict, without a cluster: a failed request, a missed aim or nothing measured
fails the run. docs/benchmarks.md renders the saved full run (tests/test_bench_docs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cluster import expected_outputs

from pdserve.bench.process_tree import Sessions
from pdserve.bench.recovery import bounding_settings, verdict
from pdserve.bench.recovery_coordinator import coordinator_kills
from pdserve.bench.recovery_nodes import node_kills
from pdserve.bench.recovery_record import (
    AIM_S,
    MIN_OUTPUTS,
    Kill,
    RequestOutcome,
    Workload,
    summarize,
)
from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig

MODEL = "pdserve-tiny"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine() -> EngineConfig:
    return EngineConfig(model=MODEL, device="cpu", kv_cache_bytes=32 << 20)


def assert_recovered_with_offline_tokens(kill: Kill, workload: Workload, engine) -> None:  # noqa: ANN001
    assert kill.error is None, kill.error
    assert kill.affected, "the kill moved no request"
    prompts = [r.prompt for r in kill.requests]
    with LLM(MODEL, device="cpu", block_size=engine.block_size) as offline:
        expected = expected_outputs(offline, prompts, workload.params)
    assert [r.tokens for r in kill.requests] == expected
    assert [r.error for r in kill.requests] == [None] * len(kill.requests)
    for r in kill.affected:
        assert r.tokens_before_kill >= MIN_OUTPUTS  # killed mid-output
        assert r.recovery_s is not None and 0 < r.recovery_s < 60


@pytest.mark.cluster
def test_a_killed_decode_node_s_requests_are_served_again_with_the_offline_tokens(engine, tmp_path):
    # Streams long enough to outlast the kill by far: it lands after 3 tokens of each.
    workload = Workload(MODEL, requests=6, max_tokens=400, seed=1)
    sessions = Sessions()
    (kill,) = node_kills("decode", 1, workload, engine, sessions, tmp_path, timeout_s=60)
    assert_recovered_with_offline_tokens(kill, workload, engine)
    # A node's death is seen by the close of its connections, never made again: it is marked
    # dead disconnect_grace_s after, well before heartbeat_timeout_s would.
    settings = bounding_settings()
    grace, timeout = settings["disconnect_grace_s"], settings["heartbeat_timeout_s"]
    assert grace <= kill.stages["marked_dead_s"] < timeout
    assert all(r.recovery_s >= kill.stages["marked_dead_s"] for r in kill.affected)
    summary = summarize("decode", [kill])
    assert summary.affected == len(kill.affected) and summary.failed == []
    assert summary.p50_s <= summary.max_s == round(max(r.recovery_s for r in kill.affected), 3)
    assert sessions.strays() == []


@pytest.mark.cluster
def test_a_killed_coordinator_is_restarted_and_every_cut_stream_is_served_again(engine, tmp_path):
    workload = Workload(MODEL, requests=4, max_tokens=400, seed=2)
    sessions = Sessions()
    (kill,) = coordinator_kills(1, workload, engine, sessions, tmp_path, timeout_s=60)
    assert_recovered_with_offline_tokens(kill, workload, engine)
    assert len(kill.affected) == len(kill.requests)  # every stream goes through it
    # Restarted by the supervisor after its first backoff step, then serving again.
    delay = bounding_settings()["supervisor_restart_delay_s"]
    assert kill.stages["restart_delay_s"] == delay
    assert delay <= kill.stages["restarted_s"] <= min(r.recovery_s for r in kill.affected)
    assert sessions.strays() == []


def kill_of(*outcomes: RequestOutcome) -> Kill:
    return Kill("decode", 0, "decode-0", list(outcomes))


def test_a_failed_request_a_missed_aim_or_nothing_measured_fails_the_run():
    fast = RequestOutcome("a", [5], affected=True, recovery_s=AIM_S["decode"] / 2)
    slow = RequestOutcome("b", [5], affected=True, recovery_s=AIM_S["decode"] * 2)
    failed = RequestOutcome("c", [5], error="failed (unavailable): no decode node is left")
    passing = summarize("decode", [kill_of(fast, RequestOutcome("d", [5]))])
    assert passing.aim_met and verdict([passing], [], aim_check=True) == []

    missed = summarize("decode", [kill_of(fast, slow)])
    assert (missed.p50_s, missed.max_s) == (AIM_S["decode"] * 1.25, AIM_S["decode"] * 2)
    assert verdict([missed], [], aim_check=True) == [
        f"decode: aim missed: max {missed.max_s:.2f} s, aim < {AIM_S['decode']:g} s"
    ]
    assert verdict([missed], [], aim_check=False) == []  # --no-aim-check

    lost = summarize("decode", [kill_of(fast, failed)])
    assert verdict([lost], [], aim_check=False) == [
        "decode: failed: c: failed (unavailable): no decode node is left"
    ]
    nothing = summarize("decode", [Kill("decode", 0, "", [], error="never reached")])
    assert not nothing.measured
    assert len(verdict([nothing], [], aim_check=False)) == 2  # the kill's error, and unmeasured
    assert verdict([passing], [(123, "pdserve-decode-0")], aim_check=True) == [
        "process left running: 123 pdserve-decode-0"
    ]


def test_the_saved_run_was_taken_on_pdserves_defaults():
    """The docs render bench/results/recovery.json (tests/test_bench_docs.py checks them); its
    settings must still be pdserve's, or the docs' explanation of the times no longer holds."""
    saved = json.loads((REPO / "bench/results/recovery.json").read_text())
    assert saved["settings"] == bounding_settings()  # still pdserve's defaults
