"""The search: bisection finds a deployment's known capacity, and the whole search returns the
optimum of a case built so that it is known."""

from __future__ import annotations

import pytest

from pdserve.tune.deployment import Deployment
from pdserve.tune.model_shape import ModelShape
from pdserve.tune.profile import Profile
from pdserve.tune.search import SearchSpace, max_rate, search, throughput_bound
from pdserve.tune.slo import SLO
from pdserve.tune.step_model import StepTimeModel
from pdserve.tune.transfer_model import TransferModel
from pdserve.tune.workload import LengthDist, synthetic

SHAPE = ModelShape("test", 2, 64, 192, 4, 2, 16, 512, 4096)


def profile(step: StepTimeModel, kv_blocks: int = 512) -> Profile:
    return Profile(SHAPE, "float32", step, TransferModel(0.001, 1e9), kv_blocks=kv_blocks)


def test_bisection_finds_a_single_node_s_prefill_capacity():
    # One 100-token prompt a step of 100 ms, one output token: ten requests a second at most.
    p = profile(StepTimeModel(per_token_s=0.001))
    workload = synthetic(400, LengthDist.parse("100"), LengthDist.parse("1"), seed=0)
    slo = SLO(ttft_s=2.0, tpot_s=1.0, attainment=0.9)
    d = Deployment(0, 1, colocated=True, max_num_batched_tokens=100)
    found = max_rate(p, d, workload, slo, hint=3.0, tolerance=0.02)
    assert 9.5 <= found.goodput <= 11.0
    passing = [pr for pr in found.probes if pr.attainment >= 0.9]
    failing = [pr for pr in found.probes if pr.attainment < 0.9]
    assert max(pr.rate for pr in passing) == found.goodput
    assert min(pr.rate for pr in failing) <= found.goodput * 1.02 + 1e-9
    assert throughput_bound(p, d, workload, slo) == pytest.approx(10.0, rel=0.05)


def test_the_search_returns_the_known_optimum_of_a_prefill_bound_case():
    # A prompt costs 200 ms to prefill; decoding is cheap. Prefill bounds every split (P nodes
    # serve 5 P req/s) while one decode node keeps up with 15 req/s; colocated workers stall
    # their decodes for every prefill, against a 30 ms TPOT target. On 4 devices: 3P + 1D.
    step = StepTimeModel(base_s=0.004, per_token_s=0.001)
    p = profile(step)
    workload = synthetic(400, LengthDist.parse("200"), LengthDist.parse("20"), seed=1)
    slo = SLO(ttft_s=1.5, tpot_s=0.030, attainment=0.9)
    space = SearchSpace(
        chunks=(256, 512),
        max_seqs=(16, 256),
        watermarks=(0.05,),
        threshold_quantiles=(0.5,),
        screen_nodes=4,
        tolerance=0.08,
        final_tolerance=0.05,
    )
    result = search(p, workload, slo, 4, space=space, processes=1)
    best = result.best
    assert (best.deployment.prefill, best.deployment.decode) == (3, 1)
    assert not best.deployment.colocated and best.deployment.conditional_disagg_threshold == 0
    assert 12.0 <= best.goodput <= 16.5
    by_placement = {e.deployment.placement: e.goodput for e in result.screened}
    assert by_placement["3P + 1D"] > by_placement.get("2P + 2D", 0.0)
    assert by_placement["4 colocated"] < best.goodput
