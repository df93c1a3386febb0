"""The chaos soak, short: 36 requests through real 1 prefill + 2 decode clusters of pdserve-tiny
under `pdserve launch`, phase by phase; the baseline serves every request identical to the
offline engine, and no phase serves a wrong token, holds a request past its deadline, ends one
unclearly or leaks a KV block. Without a cluster: the checks themselves fail when they should (a
changed token is wrong, a late answer overdue, an error body or a cut stream counted as such)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.bench import chaos
from pdserve.bench.chaos_cluster import FAULTS_ENV, KV_FAULTS_ENV, ChaosCluster
from pdserve.bench.chaos_requests import ChaosRequest, Choice, Outcome, difference, send
from pdserve.cluster.sampling_params import SamplingParams

pytestmark = pytest.mark.cluster

REQUESTS = 36
# The phases run on a cluster here, in two runs: the baseline and corrupted KV pages at a rate
# high enough that 36 requests meet some; then every PDSERVE_FAULTS kind at once (a kill or
# two among them), at a rate most requests live through.
RUNS = {"none,kv-corrupt": 0.1, "all": 0.03}
PHASES = ["none", "kv-corrupt", "all"]
RATE = RUNS["none,kv-corrupt"]


@pytest.fixture(scope="module")
def chaos_runs(tmp_path_factory) -> list[tuple[int, dict]]:
    out = []
    for phases, rate in RUNS.items():
        tmp = tmp_path_factory.mktemp("chaos")
        path = tmp / "chaos.json"
        argv = ["--requests", str(REQUESTS), "--phases", phases, "--rate", str(rate)]
        argv += ["--concurrency", "8", "--work-dir", str(tmp / "work"), "--json-out", str(path)]
        code = chaos.main([*argv, "--no-progress"])
        out.append((code, json.loads(path.read_text())))
    return out


@pytest.fixture(scope="module")
def chaos_run(chaos_runs) -> tuple[int, dict]:
    """The runs as one: exit status 1 if either failed, every phase's result."""
    first = chaos_runs[0][1]
    return max(code for code, _ in chaos_runs), {
        **first,
        "problems": [p for _, r in chaos_runs for p in r["problems"]],
        "phases": [p for _, r in chaos_runs for p in r["phases"]],
        "phase_faults": {k: v for _, r in chaos_runs for k, v in r["phase_faults"].items()},
    }


def test_the_short_run_passes_and_says_where_it_ran(chaos_run):
    code, results = chaos_run
    assert results["problems"] == [] and code == 0
    assert [p["phase"] for p in results["phases"]] == PHASES
    assert {"machine", "command", "commit", "date"} <= set(results)
    assert results["phase_faults"]["kv-corrupt"] == {KV_FAULTS_ENV: f"corrupt={RATE},seed=7"}


@pytest.mark.parametrize("phase", PHASES)
def test_a_phase_serves_no_wrong_token_nothing_late_and_leaks_no_block(chaos_run, phase):
    _, results = chaos_run
    (r,) = [p for p in results["phases"] if p["phase"] == phase]
    assert r["error"] is None and r["strays"] == []
    assert r["wrong"] == 0 and r["overdue"] == 0 and r["unclear"] == 0
    assert r["completed"] + r["total_failed"] == REQUESTS
    assert r["identical"] == r["completed"] > 0
    assert sorted(r["leaked_blocks"]) == ["decode-0", "decode-1", "prefill-0"]
    assert r["leaked"] == 0
    assert set(r["anon_growth_mib"]) >= {"coordinator", "prefill-0", "decode-0", "decode-1"}
    integrity_failures = r["counters"]["pdserve_kv_integrity_failures_total"]
    if phase == "none":
        assert r["identical"] == REQUESTS and integrity_failures == 0
    if phase == "kv-corrupt":
        assert integrity_failures > 0  # faults were injected, and caught
    if phase == "all":
        assert r["fault_log_lines"]  # every process says it injects them


# --- the checks alone ---------------------------------------------------------------------------

EXPECTED = [Choice(" ab", [" a", "b"], "length"), Choice(" c", [" c"], "stop")]


def served(*changes: tuple[int, str, object]) -> list[Choice]:
    choices = [Choice(c.text, list(c.tokens), c.finish_reason) for c in EXPECTED]
    for index, name, value in changes:
        setattr(choices[index], name, value)
    return choices


def request(index: int = 0, stream: bool = False) -> ChaosRequest:
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 2, "temperature": 0, "stream": stream}
    return ChaosRequest(index, body, [5, 6], [SamplingParams(max_tokens=2, temperature=0)])


def phase(outcomes: list[Outcome], expected: list[Choice] = EXPECTED) -> chaos.PhaseResult:
    result = chaos.PhaseResult("none", {}, len(outcomes))
    for outcome in outcomes:
        chaos.tally(result, request(outcome.index), expected, outcome, deadline_s=65.0)
    return result


def test_a_completed_response_with_one_token_changed_is_counted_wrong():
    assert difference(EXPECTED, served()) is None
    changed = served((0, "tokens", [" a", "c"]))
    assert "tokens differ at index 1" in difference(EXPECTED, changed)
    result = phase(
        [
            Outcome(0, "completed", 0.1, choices=served()),
            Outcome(1, "completed", 0.1, choices=changed),
        ]
    )
    assert (result.completed, result.identical, result.wrong) == (2, 1, 1)
    assert result.examples["wrong"][0]["index"] == 1
    assert any("served wrong tokens" in p for p in chaos.problems([result]))


def test_a_different_text_finish_or_number_of_choices_is_wrong_too():
    assert "text" in difference(EXPECTED, served((0, "text", " ax")))
    assert "finish_reason" in difference(EXPECTED, served((1, "finish_reason", "length")))
    assert "1 choices served, 2 expected" == difference(EXPECTED, served()[:1])


def test_an_answer_past_the_deadline_is_overdue_and_one_that_never_ends_too():
    result = phase(
        [
            Outcome(0, "completed", 70.0, choices=served()),  # right, but late
            Outcome(1, "hung", 95.0),
            Outcome(2, "failed", 1.0, error="HTTP 504 timeout", detail="timed out"),
        ]
    )
    assert (result.identical, result.overdue, result.hung) == (1, 2, 1)
    assert result.failed == {"HTTP 504 timeout": 1}
    assert [p for p in chaos.problems([result]) if "deadline" in p]


def test_the_baseline_short_of_all_identical_fails_the_run():
    ok = Outcome(0, "completed", 0.1, choices=served())
    failed = Outcome(1, "failed", 0.1, error="HTTP 503 unavailable", detail="no node")
    assert chaos.problems([phase([ok, ok])]) == []
    assert chaos.problems([phase([ok, failed])]) == [
        "none: 1 of 2 requests identical to the offline engine (the baseline must be all: "
        "nothing else means anything until it is)"
    ]
    leaked = phase([ok])
    leaked.leaked_blocks = {"decode-0": 3, "decode-1": 0}
    assert chaos.problems([leaked]) == [
        "none: KV blocks not free after the requests: {'decode-0': 3, 'decode-1': 0}"
    ]


def answer(handler) -> Outcome:  # noqa: ANN001
    async def go() -> Outcome:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await send(client, request(stream=True), bound_s=5.0)

    return asyncio.run(go())


def sse(*events: str) -> httpx.Response:
    body = "".join(f"data: {e}\n\n" for e in events)
    return httpx.Response(200, text=body, headers={"x-pdserve-trace-id": "t-1"})


def test_what_comes_back_is_read_as_completed_failed_or_unclear():
    chunk = '{"choices": [{"index": 0, "text": " a", "logprobs": {"tokens": [" a"]}, "finish_reason": "length"}]}'
    done = answer(lambda _: sse(chunk, "[DONE]"))
    assert done.status == "completed" and done.trace_id == "t-1"
    assert done.choices == [Choice(" a", [" a"], "length")]
    error = '{"error": {"message": "timed out", "type": "timeout_error", "param": null, "code": "timeout"}}'
    in_stream = answer(lambda _: sse(chunk.replace('"length"', "null"), error, "[DONE]"))
    assert (in_stream.status, in_stream.error) == ("failed", "stream timeout")
    refused = answer(lambda _: httpx.Response(504, text=error))
    assert (refused.status, refused.error, refused.detail) == (
        "failed",
        "HTTP 504 timeout",
        "timed out",
    )
    assert answer(lambda _: sse(chunk)).status == "unclear"  # no [DONE]
    assert (
        answer(lambda _: httpx.Response(502, text="<html>bad gateway</html>")).status == "unclear"
    )


def test_every_fault_kind_has_a_phase_and_no_phase_inherits_another_s_faults(tmp_path, monkeypatch):
    table = chaos.phase_table(0.02, 7)
    assert table["none"] == {}
    assert table["drop"] == {FAULTS_ENV: "drop=0.02,seed=7"}
    assert table["stall"] == {FAULTS_ENV: "stall=0.002,seed=7"}
    assert table["kill"] == {FAULTS_ENV: "kill=0.0005,seed=7"}
    assert set(chaos.KINDS) < set(table) and set(table) == set(chaos.PHASES)
    assert all(f"{kind}=" in table["all"][FAULTS_ENV] for kind in chaos.KINDS)
    assert table["all"][KV_FAULTS_ENV] == "corrupt=0.02,seed=7"
    assert "delay_ms=5" in chaos.phase_table(0.02, 7, delay_ms=5)["delay"][FAULTS_ENV]
    monkeypatch.setenv(FAULTS_ENV, "drop=1.0")
    monkeypatch.setenv(KV_FAULTS_ENV, "corrupt=1.0")
    cluster = ChaosCluster(tmp_path, "pdserve-tiny", {"request_timeout_s": 60.0}, {})
    assert FAULTS_ENV not in cluster.env and KV_FAULTS_ENV not in cluster.env
    assert "request_timeout_s = 60.0" in (tmp_path / "pdserve.toml").read_text()


def test_memory_growth_is_not_measured_across_a_restart():
    def at(requests: int, pid: int, anon: float) -> dict:
        return {"requests": requests, "memory": {"decode-0": {"pid": pid, "anon": anon}}}

    steady = [at(0, 10, 100.0), at(50, 10, 140.0), at(100, 10, 141.5)]
    assert chaos.growth(steady) == {"decode-0": 41.5}
    assert chaos.growth(steady, after=50) == {"decode-0": 1.5}
    restarted = [at(0, 10, 100.0), at(50, 11, 20.0), at(100, 11, 300.0)]
    assert chaos.growth(restarted) == {"decode-0": None}
    assert chaos.growth(restarted, after=50) == {"decode-0": None}


def test_a_failed_baseline_skips_the_other_phases_and_the_run_exits_1(tmp_path, monkeypatch):
    ran = []

    def run_phase(args, name, faults, requests, expected):  # noqa: ANN001
        ran.append(name)
        ok = Outcome(0, "completed", 0.1, choices=served())
        return phase([ok, Outcome(1, "failed", 0.1, error="HTTP 503 unavailable")])

    monkeypatch.setattr(chaos, "prepare", lambda args: ([request(0), request(1)], [EXPECTED] * 2))
    monkeypatch.setattr(chaos, "run_phase", run_phase)
    out = tmp_path / "chaos.json"
    assert chaos.main(["--phases", "none,kv-corrupt,drop", "--json-out", str(out)]) == 1
    results = json.loads(out.read_text())
    assert ran == ["none"] and results["skipped"] == ["kv-corrupt", "drop"]
    assert results["problems"][0].startswith("none: 1 of 2 requests identical")
