"""The serving objective, defined once for the simulator and the measured load: TPOT, what meets
the SLO, attainment and goodput; a simulated outcome and a measured request with the same figures
count alike."""

from __future__ import annotations

import pytest

from pdserve.tune.metrics import Outcome
from pdserve.tune.serving_metrics import RequestResult
from pdserve.tune.slo import SLO, attainment, goodput, time_per_output_token

SLO_1S_100MS = SLO(ttft_s=1.0, tpot_s=0.1)
# (success, TTFT, latency, output tokens): met, met (one token), TTFT missed, failed, TPOT missed
FIGURES = [
    (True, 0.2, 0.65, 10),
    (True, 0.3, 0.3, 1),
    (True, 1.4, 2.0, 40),
    (False, 0.0, 0.0, 0),
    (True, 0.1, 0.9, 5),
]


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert time_per_output_token(0.2, 0.65, 10) == pytest.approx(0.05)
    assert time_per_output_token(0.3, 0.3, 1) == 0.0
    assert time_per_output_token(0.3, 0.9, 0) == 0.0


def test_a_request_meets_the_slo_only_if_it_succeeded_within_both_targets():
    assert SLO_1S_100MS.met(True, 1.0, 0.1)  # at both limits
    assert not SLO_1S_100MS.met(True, 1.01, 0.05)
    assert not SLO_1S_100MS.met(True, 0.5, 0.11)
    assert not SLO_1S_100MS.met(False, 0.1, 0.01)
    assert SLO(1.0, 0.1).attainment == 0.9  # what goodput asks of a run, unless said


def test_attainment_counts_failures_as_misses_and_goodput_is_met_requests_per_second():
    outcomes = [Outcome(ok, 0.0, n, ttft, latency) for ok, ttft, latency, n in FIGURES]
    assert [o.meets(SLO_1S_100MS) for o in outcomes] == [True, True, False, False, False]
    assert attainment(outcomes, SLO_1S_100MS) == pytest.approx(2 / 5)
    assert goodput(outcomes, SLO_1S_100MS, duration_s=4.0) == pytest.approx(0.5)
    assert attainment([], SLO_1S_100MS) == 0.0
    assert goodput(outcomes, SLO_1S_100MS, duration_s=0.0) == 0.0


def test_a_simulated_outcome_and_a_measured_request_count_alike():
    outcomes = [Outcome(ok, 0.0, n, ttft, latency) for ok, ttft, latency, n in FIGURES]
    results = [
        RequestResult(ok, 8, n, n, ttft=ttft, latency=latency) for ok, ttft, latency, n in FIGURES
    ]
    assert [o.tpot_s for o in outcomes] == [r.tpot for r in results]
    assert [o.meets(SLO_1S_100MS) for o in outcomes] == [r.meets(SLO_1S_100MS) for r in results]
