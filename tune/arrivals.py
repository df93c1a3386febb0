"""When requests are sent: open-loop arrivals whose gaps are gamma-distributed with mean 1/rate.
Shape `burstiness` = 1 is a Poisson process; below 1 arrivals come in bursts (CV = 1/sqrt(shape)),
above 1 they are more even. An infinite rate sends everything at once (with a concurrency cap,
that is a closed loop at fixed concurrency)."""

from __future__ import annotations

import math

import numpy as np


def inter_arrival_times(
    num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Gaps in seconds before each request; the first request's gap is the first element."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    # Gamma(shape=k, scale=1/(k*rate)) has mean 1/rate and coefficient of variation 1/sqrt(k).
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)


def arrival_offsets(
    num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send times in seconds from the start of the run; the first request goes at 0."""
    gaps = inter_arrival_times(num_requests, rate, burstiness, seed)
    if num_requests == 0:
        return gaps
    return np.cumsum(gaps) - gaps[0]
