"""The serving objective and what a run's requests come to against it, defined once for the
simulator (`tune/metrics.py`) and the measured load (`tune/serving_metrics.py`): a TTFT and a TPOT
target; TPOT = (latency - TTFT) / (outputs - 1); SLO attainment, the fraction of all requests
(failures counting as misses) within both targets; goodput, those requests per second."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # the fraction of requests that must meet both, for goodput

    def met(self, success: bool, ttft_s: float, tpot_s: float) -> bool:
        """Whether a request with these figures meets both targets (a failed one never does)."""
        return success and ttft_s <= self.ttft_s and tpot_s <= self.tpot_s


def time_per_output_token(ttft_s: float, latency_s: float, output_len: int) -> float:
    """Mean time per output token after the first; 0 for one-token outputs."""
    if output_len <= 1:
        return 0.0
    return (latency_s - ttft_s) / (output_len - 1)


class Served(Protocol):
    """A request as a run measured or simulated it."""

    def meets(self, slo: SLO) -> bool: ...


def attainment(requests: Sequence[Served], slo: SLO) -> float:
    """The fraction of all requests, failures counting as misses, that met the SLO; 0 for none."""
    return sum(r.meets(slo) for r in requests) / len(requests) if requests else 0.0


def goodput(requests: Iterable[Served], slo: SLO, duration_s: float) -> float:
    """Requests per second of `duration_s` that succeeded within both targets."""
    if duration_s <= 0:
        return 0.0
    return sum(r.meets(slo) for r in requests) / duration_s
