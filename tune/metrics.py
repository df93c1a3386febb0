"""What a simulated run measured, by the measured load's definitions (`tune/slo.py`,
`tune/serving_metrics.py`): per request TTFT, TPOT and success; per run the SLO attainment,
goodput (over the run, first arrival to last end) and latency percentiles."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.tune.serving_metrics import percentiles
from pdserve.tune.slo import SLO, attainment, goodput, time_per_output_token


@dataclass(slots=True)
class Outcome:
    success: bool
    arrival_s: float  # from the start of the run
    output_len: int
    ttft_s: float = 0.0
    latency_s: float = 0.0  # arrival to the last token

    @property
    def tpot_s(self) -> float:
        return time_per_output_token(self.ttft_s, self.latency_s, self.output_len)

    def meets(self, slo: SLO) -> bool:
        return slo.met(self.success, self.ttft_s, self.tpot_s)


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
    return Summary(
        rate=rate,
        num_requests=len(outcomes),
        completed=len(ok),
        duration_s=duration,
        attainment=attainment(outcomes, slo),
        goodput=goodput(outcomes, slo, duration),
        throughput=len(ok) / duration if duration > 0 else 0.0,
        ttft_ms=percentiles([o.ttft_s for o in ok], 1e3),
        tpot_ms=percentiles([o.tpot_s for o in ok if o.output_len > 1], 1e3),
    )
