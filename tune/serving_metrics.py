"""What one request measured (TTFT, inter-token latencies, end-to-end latency) and what a run
of them sums to: mean and percentiles, request and token throughput, SLO attainment and goodput
(as `tune/slo.py` defines them, for the simulator too)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pdserve.tune.slo import SLO, attainment, goodput, time_per_output_token

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    success: bool
    prompt_len: int  # tokens: the server's count when it reports usage, else the workload's
    output_len: int  # tokens generated: usage.completion_tokens, else the streamed token chunks
    expected_output_len: int  # what the workload asked for (max_tokens)
    kind: str = "short"
    send_time: float = 0.0  # seconds from the start of the run
    ttft: float = 0.0  # seconds from send to the first token chunk
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between token chunks
    error: str = ""

    @property
    def tpot(self) -> float:
        return time_per_output_token(self.ttft, self.latency, self.output_len)

    def meets(self, slo: SLO) -> bool:
        return slo.met(self.success, self.ttft, self.tpot)

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot": self.tpot}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default);
    NaN for no values."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50, p90, p99 of values times scale (1e3 for seconds to milliseconds); NaN for no values."""
    arr = np.asarray(values, dtype=float) * scale
    return {f"p{q}": percentile(arr, q) for q in PERCENTILES}


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 of values times scale (1e3 for seconds to milliseconds)."""
    arr = np.asarray(values, dtype=float) * scale
    return {"mean": float(arr.mean()) if len(arr) else float("nan"), **percentiles(arr)}


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict:
    """The run's figures; latencies in milliseconds, throughputs per second of `duration_s`."""
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_len for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    per_second = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "output_len_mismatches": sum(r.output_len != r.expected_output_len for r in ok),
        "duration_s": duration_s,
        "request_throughput": per_second(len(ok)),
        "output_token_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "ttft_ms": distribution([r.ttft for r in ok], 1e3),
        "tpot_ms": distribution([r.tpot for r in ok if r.output_len > 1], 1e3),
        "itl_ms": distribution([gap for r in ok for gap in r.itl], 1e3),
        "e2el_ms": distribution([r.latency for r in ok], 1e3),
        "slo": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3},
        "slo_attainment": attainment(results, slo),
        "goodput": goodput(results, slo, duration_s),
        "by_kind": {
            kind: latencies([r for r in ok if r.kind == kind])
            for kind in sorted({r.kind for r in ok})
        },
    }


def latencies(results: Sequence[RequestResult]) -> dict:
    """TTFT, TPOT and end-to-end latency (ms) of some successful requests, e.g. of one kind."""
    return {
        "count": len(results),
        "ttft_ms": distribution([r.ttft for r in results], 1e3),
        "tpot_ms": distribution([r.tpot for r in results if r.output_len > 1], 1e3),
        # First to second token: on a disaggregated cluster, the KV handoff's share of latency.
        "first_itl_ms": distribution([r.itl[0] for r in results if r.itl], 1e3),
        "e2el_ms": distribution([r.latency for r in results], 1e3),
    }


def throughput_at_latency(
    points: Sequence[tuple[float, float]], latency_limit: float
) -> float | None:
    """Given (throughput, latency) points of a sweep in order of offered load, the throughput at
    which latency reaches `latency_limit`, interpolated linearly between the last point within
    it and the next; the best point's throughput if none exceeds it; None if none is within it."""
    best = None
    for i, (thr, lat) in enumerate(points):
        if lat <= latency_limit:
            best = thr if best is None else max(best, thr)
            continue
        if i > 0 and points[i - 1][1] <= latency_limit:
            (t0, l0), (t1, l1) = points[i - 1], (thr, lat)
            crossing = t0 + (t1 - t0) * (latency_limit - l0) / (l1 - l0)
            best = max(best if best is not None else crossing, crossing)
        break
    return best
