"""What a simulated run measured, with a real load's definitions (`tune/serving_metrics.py`, kept
equal by a test): per request TTFT, TPOT = (latency - TTFT) / (outputs - 1), success; per run
the SLO attainment (the fraction of all requests, failures counting as misses, within both the TTFT
and the TPOT target), goodput (those requests per second of the run, first arrival to last end),
and latency percentiles (linear interpolation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # the fraction of requests that must meet both, for goodput


@dataclass(slots=True)
class Outcome:
    success: bool
    arrival_s: float  # from the start of the run
    output_len: int
    ttft_s: float = 0.0
    latency_s: float = 0.0  # arrival to the last token

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; 0 for one-token outputs."""
        if self.output_len <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)

    def meets(self, slo: SLO) -> bool:
        return self.success and self.ttft_s <= slo.ttft_s and self.tpot_s <= slo.tpot_s


def percentiles(values: Sequence[float], scale: float = 1e3) -> dict[str, float]:
    """p50, p90, p99 (milliseconds for seconds by default); NaN for no values."""
    if len(values) == 0:
        return {f"p{q}": float("nan") for q in PERCENTILES}
    arr = np.asarray(values, dtype=float) * scale
    return {f"p{q}": float(np.percentile(arr, q)) for q in PERCENTILES}


@dataclass(slots=True)
class Summary:
    rate: float  # offered, requests per second
    num_requests: int
    completed: int
    duration_s: float
    attainment: float
    goodput: float  # requests per second meeting the SLO
    throughput: float  # completed requests per second
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    stopped_early: bool = False  # the run ended once the SLO could no longer be met
    peak_kv_usage: float = 0.0  # the fullest a decoding node's KV pool was

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def summarize(outcomes: Sequence[Outcome], slo: SLO, rate: float) -> Summary:
    ok = [o for o in outcomes if o.success]
    start = min((o.arrival_s for o in outcomes), default=0.0)
    end = max((o.arrival_s + o.latency_s for o in outcomes), default=0.0)
    duration = end - start
    met = sum(o.meets(slo) for o in outcomes)
    return Summary(
        rate=rate,
        num_requests=len(outcomes),
        completed=len(ok),
        duration_s=duration,
        attainment=met / len(outcomes) if outcomes else 0.0,
        goodput=met / duration if duration > 0 else 0.0,
        throughput=len(ok) / duration if duration > 0 else 0.0,
        ttft_ms=percentiles([o.ttft_s for o in ok]),
        tpot_ms=percentiles([o.tpot_s for o in ok if o.output_len > 1]),
    )
