"""The serving benchmark's own logic, without pdserve: percentiles, goodput, the arrival
processes, the workload sampler, SSE parsing and timing, and a run against a fake server."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import numpy as np
import pytest

from pdserve.bench.serving.report import aims, tpot_inflation
from pdserve.tune.arrivals import arrival_offsets, inter_arrival_times
from pdserve.tune.completion_stream import CompletionTimer, SSEDecoder, completion_body
from pdserve.tune.load_generator import LoadConfig, run_load
from pdserve.tune.serving_metrics import (
    RequestResult,
    distribution,
    percentile,
    summarize,
    throughput_at_latency,
)
from pdserve.tune.serving_workload import RequestSpec, SyntheticWorkload, load_sharegpt
from pdserve.tune.slo import SLO, goodput


def result(ttft: float, latency: float, output_len: int, success: bool = True) -> RequestResult:
    return RequestResult(success, 10, output_len, output_len, ttft=ttft, latency=latency)


# --- percentiles and summaries -----------------------------------------------------------------


def test_percentile_interpolates_linearly_between_order_statistics():
    values = list(range(1, 11))  # 1..10
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_distribution_scales_seconds_to_milliseconds():
    d = distribution([0.001, 0.002, 0.003], scale=1e3)
    assert d["mean"] == pytest.approx(2.0)
    assert d["p50"] == pytest.approx(2.0)
    assert d["p99"] == pytest.approx(2.98)


def test_tpot_excludes_the_first_token_and_is_zero_for_one_token():
    assert result(0.1, 1.0, 10).tpot == pytest.approx(0.1)
    assert result(0.1, 0.1, 1).tpot == 0.0


def test_goodput_counts_requests_meeting_both_slos_per_second():
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    results = [
        result(0.1, 0.1 + 9 * 0.04, 10),  # meets both
        result(0.6, 0.6 + 9 * 0.04, 10),  # TTFT too slow
        result(0.1, 0.1 + 9 * 0.06, 10),  # TPOT too slow
        result(0.5, 0.5 + 9 * 0.05, 10),  # exactly at both limits: meets
        result(0.1, 0.2, 10, success=False),  # failed: never counts
    ]
    assert goodput(results, slo, duration_s=2.0) == pytest.approx(1.0)
    summary = summarize(results, 2.0, slo)
    assert summary["slo_attainment"] == pytest.approx(2 / 5)
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["output_token_throughput"] == pytest.approx(20.0)
    assert summary["total_token_throughput"] == pytest.approx(40.0)


def test_throughput_at_latency_interpolates_where_the_curve_crosses_the_limit():
    points = [(1.0, 100.0), (2.0, 200.0), (3.0, 600.0)]
    assert throughput_at_latency(points, 400.0) == pytest.approx(2.5)
    assert throughput_at_latency(points, 1000.0) == pytest.approx(3.0)
    assert throughput_at_latency(points, 50.0) is None
    # Past the first crossing, later points do not count even if they dip back under.
    assert throughput_at_latency([(1.0, 100.0), (2.0, 900.0), (3.0, 150.0)], 500.0) == (
        pytest.approx(1.5)
    )


# --- arrivals ----------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_requested_mean_rate_and_unit_cv():
    gaps = inter_arrival_times(20_000, rate=4.0, burstiness=1.0, seed=0)
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_have_cv_one_over_sqrt_shape(burstiness: float):
    gaps = inter_arrival_times(20_000, rate=10.0, burstiness=burstiness, seed=1)
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded_start_at_zero_and_infinite_rate_sends_at_once():
    a = arrival_offsets(50, rate=2.0, seed=7)
    assert np.array_equal(a, arrival_offsets(50, rate=2.0, seed=7))
    assert not np.array_equal(a, arrival_offsets(50, rate=2.0, seed=8))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert np.array_equal(arrival_offsets(5, rate=math.inf), np.zeros(5))
    with pytest.raises(ValueError):
        inter_arrival_times(5, rate=0.0)


# --- workloads ---------------------------------------------------------------------------------


def test_synthetic_workload_mixes_an_exact_fraction_of_long_prompts_within_ranges():
    w = SyntheticWorkload(long_fraction=0.2, token_id_range=(10, 500))
    specs = w.sample(50, seed=3)
    longs = [s for s in specs if s.kind == "long"]
    assert len(longs) == 10
    for s in specs:
        prompt_range = w.long_prompt_len if s.kind == "long" else w.short_prompt_len
        output_range = w.long_output_len if s.kind == "long" else w.short_output_len
        assert prompt_range[0] <= s.prompt_len <= prompt_range[1]
        assert output_range[0] <= s.output_len <= output_range[1]
        assert len(s.prompt) == s.prompt_len
        assert all(10 <= t < 500 for t in s.prompt)
    assert specs == w.sample(50, seed=3)
    assert specs != w.sample(50, seed=4)


def test_text_prompts_have_one_word_per_intended_token():
    specs = SyntheticWorkload(prompt_format="text").sample(5, seed=0)
    assert all(len(s.prompt.split()) == s.prompt_len for s in specs)


def test_sharegpt_loader_skips_short_and_long_conversations(tmp_path):
    def conv(human: str, gpt: str) -> dict:
        return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}

    data = [conv("a " * 40, "b " * 80), conv("hi", "b " * 80), conv("a " * 5000, "b"), {"x": 1}]
    data += [conv("c " * 20, "d " * 30)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    count = lambda text: len(text.split())  # noqa: E731
    specs = load_sharegpt(path, 2, seed=0, count_tokens=count)
    assert sorted((s.prompt_len, s.output_len) for s in specs) == [(20, 30), (40, 80)]
    with pytest.raises(ValueError, match="only 2 usable"):
        load_sharegpt(path, 3, seed=0, count_tokens=count)


# --- SSE parsing and timing ----------------------------------------------------------------------


def test_sse_decoder_joins_data_lines_and_skips_comments_and_other_fields():
    d = SSEDecoder()
    lines = [": keep-alive", "event: message", 'data: {"a":', "data: 1}", "", "data:[DONE]\r", ""]
    assert [x for x in map(d.feed, lines) if x is not None] == ['{"a":\n1}', "[DONE]"]
    d.feed("data: tail")
    assert d.flush() == "tail" and d.flush() is None


def chunk(text: str, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def test_timer_takes_ttft_from_the_first_token_chunk_and_gaps_between_chunks():
    timer = CompletionTimer(start=10.0)
    stream = [
        (10.25, chunk("a")),
        (10.30, chunk("b")),
        (10.40, chunk("c")),
        (10.41, chunk("", "length")),
        (10.42, json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})),
        (10.43, "[DONE]"),
    ]
    for now, data in stream:
        timer.on_event(data, now)
    r = timer.result(RequestSpec([1] * 5, 5, 3), send_time=0.0, now=11.0)
    assert r.success and r.error == ""
    assert r.ttft == pytest.approx(0.25)
    assert r.itl == pytest.approx([0.05, 0.10])
    assert r.latency == pytest.approx(0.43)
    assert (r.prompt_len, r.output_len) == (7, 3)
    assert r.tpot == pytest.approx((0.43 - 0.25) / 2)


def test_timer_counts_chunks_without_usage_and_reports_errors():
    timer = CompletionTimer(start=0.0)
    for now, data in [(0.1, chunk("a")), (0.2, chunk("b", "length")), (0.3, "[DONE]")]:
        timer.on_event(data, now)
    r = timer.result(RequestSpec("x y", 2, 4), 0.0, 0.3)
    assert (r.prompt_len, r.output_len, r.expected_output_len) == (2, 2, 4)
    failed = CompletionTimer(start=0.0)
    failed.on_event(json.dumps({"error": {"message": "overloaded"}}), 0.1)
    r = failed.result(RequestSpec("x", 1, 4), 0.0, 0.1)
    assert not r.success and r.error == "overloaded"


def test_request_body_asks_for_ignore_eos_streaming_and_usage():
    body = completion_body(RequestSpec([5, 6], 2, 9), "m", include_usage=True)
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 9
    assert body["stream_options"] == {"include_usage": True} and body["prompt"] == [5, 6]
    assert "stream_options" not in completion_body(RequestSpec("x", 1, 1), None, False)


# --- a run against a fake server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    from pdserve.bench.serving.fake_server import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(ttft_s=0.05, tpot_s=0.01), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
    sock.close()


def test_load_against_a_fake_server_measures_its_pace(fake_server: str):
    specs = SyntheticWorkload(short_output_len=(5, 8)).sample(6, seed=0)
    specs.append(RequestSpec("", 0, 4))  # the fake server refuses an empty prompt
    cfg = LoadConfig(fake_server, rate=math.inf, max_concurrency=4, progress=False)
    run = asyncio.run(run_load(specs, cfg, SLO(60.0, 5.0)))  # met unless it failed
    assert run["config"]["model"] == "fake"
    s = run["summary"]
    assert (s["completed"], s["failed"], s["output_len_mismatches"]) == (6, 1, 0)
    assert "HTTP 400" in run["requests"][-1]["error"]
    for r in run["requests"][:6]:
        assert r["ttft"] >= 0.05
        assert len(r["itl"]) == r["output_len"] - 1
        # At least the server's pace (no upper bound: a loaded machine only slows it), and the
        # gaps lie within the stream's time after its first token.
        assert r["tpot"] >= 0.009
        assert sum(r["itl"]) <= r["latency"] - r["ttft"] + 1e-6
    assert s["ttft_ms"]["p50"] >= 50 and s["slo_attainment"] == pytest.approx(6 / 7)


# --- the report --------------------------------------------------------------------------------


def fake_sweep(system: str, variant: str, tpot_p99: list[float], goodputs: list[float]) -> dict:
    points = [
        {
            "config": {"rate": float(i + 1)},
            "summary": {
                "by_kind": {"short": {"tpot_ms": {"p99": t}}},
                "goodput": g,
                "request_throughput": float(i + 1),
                "e2el_ms": {"p99": 1000.0 * (i + 1)},
            },
        }
        for i, (t, g) in enumerate(zip(tpot_p99, goodputs))
    ]
    return {
        "label": f"{system} ({variant})",
        "system": system,
        "variant": variant,
        "points": points,
    }


def test_aims_report_tpot_inflation_and_goodput_ratios():
    sweeps = [
        fake_sweep("disaggregated", "mixed", [12.0, 14.0], [1.0, 2.0]),
        fake_sweep("disaggregated", "short-only", [10.0, 10.0], [1.0, 2.0]),
        fake_sweep("colocated", "mixed", [30.0, 40.0], [1.0, 1.0]),
        fake_sweep("colocated", "short-only", [10.0, 10.0], [1.0, 2.0]),
    ]
    assert tpot_inflation(sweeps, "disaggregated") == [(1.0, 10.0, 12.0), (2.0, 10.0, 14.0)]
    lines = aims(sweeps, "disaggregated", "colocated", None)
    assert "1.20x" in lines[0] and "3.00x" in lines[0] and "(met)" in lines[0]
    assert "2.00x" in lines[3]


def test_timer_counts_tokens_from_logprobs_when_a_chunk_carries_several():
    timer = CompletionTimer(start=0.0)
    two = {"choices": [{"text": "ab", "finish_reason": None, "logprobs": {"tokens": ["a", "b"]}}]}
    for now, data in [(0.1, json.dumps(two)), (0.2, chunk("c")), (0.3, "[DONE]")]:
        timer.on_event(data, now)
    assert timer.result(RequestSpec("x", 1, 3), 0.0, 0.3).output_len == 3


def test_sse_lines_end_only_at_cr_lf_or_crlf_even_split_across_chunks():
    import asyncio

    from pdserve.tune.completion_stream import sse_lines

    async def lines(chunks: list[str]) -> list[str]:
        async def gen():
            for c in chunks:
                yield c

        return [line async for line in sse_lines(gen())]

    # A payload with U+2028, U+0085 and a form feed unescaped (valid JSON, as vLLM's server
    # sends it) is one line; str.splitlines would cut it in four.
    text = 'data: {"text": "a\u2028b\x85c\x0cd"}'
    assert asyncio.run(lines([text + "\r\n", "\r\n"])) == [text, ""]
    # CRLF split between two chunks is one line end; a lone CR or LF is one too.
    assert asyncio.run(lines(["data: 1\r", "\ndata: 2\rdata: 3\n", "\n"])) == [
        "data: 1", "data: 2", "data: 3", "",
    ]  # fmt: skip
    assert asyncio.run(lines(["data: 4"])) == ["data: 4"]
