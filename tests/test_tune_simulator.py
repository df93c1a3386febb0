"""The simulator: its clock against hand-computed timelines, and pdserve's own policies running
inside it (admission within a node's blocks, no leaked blocks, conditional disaggregation, prefix
caching, preemption)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pdserve.cluster.node_messages import Admit, Admitted, Generate, Prefill
from pdserve.tune.deployment import Deployment
from pdserve.tune.metrics import Outcome, summarize
from pdserve.tune.model_shape import ModelShape
from pdserve.tune.profile import Profile
from pdserve.tune.simulator import Simulation
from pdserve.tune.slo import SLO
from pdserve.tune.step_model import StepTimeModel
from pdserve.tune.transfer_model import TransferModel
from pdserve.tune.workload import LengthDist, SimRequest, synthetic

SHAPE = ModelShape("test", 2, 64, 192, 4, 2, 16, 512, 2048)
STEP_S = 0.010
HOP_S = 0.001


def profile(step: StepTimeModel | None = None, kv_blocks: int = 256, **kw: object) -> Profile:
    return Profile(
        SHAPE,
        "float32",
        step or StepTimeModel(base_s=STEP_S),  # every step the same, whatever it holds
        TransferModel(latency_s=0.002, bytes_per_s=1e9),
        kv_blocks=kv_blocks,
        hop_s=HOP_S,
        **kw,
    )


def run(d: Deployment, requests: list[SimRequest], p: Profile | None = None, slo=None):
    sim = Simulation(d, p or profile())
    return sim, sim.run(requests, slo)


def test_one_colocated_node_with_constant_steps_gives_the_hand_computed_ttft_and_tpot():
    # Generate reaches the node one hop after the request; its prefill step samples the first
    # token, which reaches the coordinator one hop after the step; then one token a step.
    p = profile(frontend_s=0.005)
    _, result = run(Deployment(0, 1, colocated=True), [SimRequest(0.0, 32, 5)], p)
    (outcome,) = result.outcomes
    assert outcome.success and outcome.output_len == 5
    assert outcome.ttft_s == pytest.approx(HOP_S + STEP_S + HOP_S + 0.005, rel=1e-12)
    assert outcome.tpot_s == pytest.approx(STEP_S, rel=1e-12)


def test_a_served_steps_overhead_lengthens_every_step_by_it():
    # What a served step takes beyond the model (measured against a real server) is one more
    # constant in every step: the prefill's and each decode's.
    overhead = 0.003
    p = profile(frontend_s=0.005, step_overhead_s=overhead)
    _, result = run(Deployment(0, 1, colocated=True), [SimRequest(0.0, 32, 5)], p)
    (outcome,) = result.outcomes
    assert outcome.ttft_s == pytest.approx(HOP_S + STEP_S + overhead + HOP_S + 0.005, rel=1e-12)
    assert outcome.tpot_s == pytest.approx(STEP_S + overhead, rel=1e-12)
    assert Profile.from_dict(p.to_dict()).step_overhead_s == overhead


def test_a_request_arriving_mid_step_waits_for_the_step_to_end():
    # The second arrives 4 ms into the first's prefill step: its Generate is handled when that
    # step ends, and it is prefilled alongside the first's first decode.
    requests = [SimRequest(0.0, 32, 3), SimRequest(0.004, 32, 3)]
    _, result = run(Deployment(0, 1, colocated=True), requests)
    first, second = result.outcomes
    assert first.ttft_s == pytest.approx(HOP_S + STEP_S + HOP_S, rel=1e-12)
    step_ends = HOP_S + STEP_S  # the first's prefill step, from the first arrival
    assert second.ttft_s == pytest.approx(step_ends + STEP_S + HOP_S - 0.004, rel=1e-12)
    assert first.tpot_s == pytest.approx(STEP_S, rel=1e-12)
    assert second.tpot_s == pytest.approx(STEP_S, rel=1e-12)


def test_a_disaggregated_request_pays_admission_the_transfer_and_hops_once():
    p = profile()
    prompt, outputs = 32, 6
    _, result = run(Deployment(1, 1), [SimRequest(0.0, prompt, outputs)], p)
    (outcome,) = result.outcomes
    # Prefill order, prefill step, FirstToken.
    assert outcome.ttft_s == pytest.approx(HOP_S + STEP_S + HOP_S, rel=1e-12)
    # Then Admit, Admitted, SendKV (one hop each), the transfer of the prompt's 2 blocks, the
    # decode node's step and its Tokens report; then one token a step.
    transfer = p.transfer.latency_s + 2 * p.kv_bytes_per_block / p.transfer.bytes_per_s
    second_gap = 3 * HOP_S + transfer + STEP_S + HOP_S
    expected = (second_gap + (outputs - 2) * STEP_S) / (outputs - 1)
    assert outcome.tpot_s == pytest.approx(expected, rel=1e-12)


class Recorder:
    """Watches a simulation's orders and reports: at every Admit, what the coordinator believed
    of the node; at every Admitted, what the node really had."""

    def __init__(self, sim: Simulation) -> None:
        self.admits = self.refused = 0
        self.overcommitted = 0  # admissions beyond what the node last reported free
        self.false_refusals = 0  # refusals of a node that had the blocks
        self.peak_used: dict[str, int] = {}
        deliver, report = sim._node_receives, sim.to_coordinator

        def on_order(identity: bytes, order: object) -> None:
            if isinstance(order, Admit):
                self.admits += 1
                self.overcommitted += sim.core.nodes.nodes[identity.decode()].available_blocks < 0
            deliver(identity, order)
            for node in sim.nodes.values():
                used = node.engine.block_manager.num_used_blocks
                self.peak_used[node.link.node_id] = max(
                    self.peak_used.get(node.link.node_id, 0), used
                )

        def on_report(identity: bytes, msg: object) -> None:
            if isinstance(msg, Admitted) and not msg.ok:
                self.refused += 1
                bm = sim.nodes[identity].engine.block_manager
                self.false_refusals += bm.num_free_blocks >= 19  # the longest prompt's blocks
            report(identity, msg)

        sim._node_receives, sim.to_coordinator = on_order, on_report


def test_admission_stays_within_reported_blocks_refusals_are_retried_and_no_block_leaks():
    # Small decode pools and long outputs: sequences wait at the coordinator for room, and the
    # decode nodes' sequences grow between their reports.
    p = profile(kv_blocks=96)
    workload = synthetic(60, LengthDist.parse("100:300"), LengthDist.parse("50:150"), seed=3)
    sim = Simulation(Deployment(1, 2, admission_watermark=0.05), p)
    recorder = Recorder(sim)
    result = sim.run(workload.at_rate(40.0))
    assert all(
        o.success and o.output_len == r.output_len
        for o, r in zip(result.outcomes, workload.requests)
    )
    assert recorder.admits >= 60 and recorder.overcommitted == 0
    # Reports are up to a heartbeat old: a node whose sequences grew since refuses, truly full,
    # and the sequence is admitted again after its next report.
    assert recorder.false_refusals == 0
    assert recorder.admits == 60 + recorder.refused
    for node in sim.nodes.values():
        bm = node.engine.block_manager
        assert recorder.peak_used[node.link.node_id] <= bm.num_blocks
        assert bm.num_free_blocks == bm.num_blocks  # every block came back
    assert max(recorder.peak_used[f"decode-{i}"] for i in range(2)) > 96 * 0.8  # it was full


def test_conditional_disaggregation_prefills_short_prompts_where_they_decode():
    seen: list[type] = []
    sim = Simulation(Deployment(1, 1, conditional_disagg_threshold=64), profile())
    deliver = sim._node_receives
    sim._node_receives = lambda i, o: (seen.append(type(o)), deliver(i, o))[1]
    result = sim.run([SimRequest(0.0, 20, 4), SimRequest(0.5, 200, 4)])
    assert all(o.success for o in result.outcomes)
    assert seen.count(Generate) == 1 and seen.count(Prefill) == 1


def test_prefix_caching_and_affinity_reuse_a_shared_prompt_prefix():
    workload = synthetic(
        20, LengthDist.parse("40"), LengthDist.parse("4"), shared_prefix_len=256, seed=1
    )
    sim = Simulation(Deployment(2, 1), profile())
    result = sim.run(workload.at_rate(5.0))
    assert all(o.success for o in result.outcomes)
    prefill = [n.engine.block_manager for n in sim.nodes.values() if n.link.node_id[0] == "p"]
    hits = [bm.prefix_hits for bm in prefill]
    # Affinity sends every prompt to the node that holds the prefix: 16 shared blocks per hit.
    assert sum(hits) == 19 * 16 and min(hits) == 0


def test_placement_by_uncached_tokens_prefills_a_mostly_cached_prompt_where_it_decodes():
    # The nodes' KV events reach the coordinator's prefix index in the simulation too: once the
    # decode node holds the shared prefix, a prompt with at most 64 tokens after it is
    # prefilled there.
    workload = synthetic(
        12, LengthDist.parse("40"), LengthDist.parse("4"), shared_prefix_len=256, seed=1
    )
    for limit, local in ((64, True), (0, False)):
        seen: list[type] = []
        sim = Simulation(Deployment(1, 1, local_prefill_max_uncached_tokens=limit), profile())
        deliver = sim._node_receives
        sim._node_receives = lambda i, o, seen=seen, deliver=deliver: (
            seen.append(type(o)),
            deliver(i, o),
        )[1]
        result = sim.run(workload.at_rate(2.0))
        assert all(o.success for o in result.outcomes)
        if local:
            assert seen.count(Generate) >= 9 and seen.count(Prefill) <= 3
        else:
            assert seen.count(Generate) == 0 and seen.count(Prefill) == 12


def test_a_node_short_of_blocks_preempts_and_still_finishes_every_request():
    p = profile(kv_blocks=24)  # 384 tokens for two sequences that grow to 300 each
    requests = [SimRequest(0.0, 100, 200), SimRequest(0.0, 100, 200)]
    sim, result = run(Deployment(0, 1, colocated=True), requests, p)
    assert [o.output_len for o in result.outcomes] == [200, 200]
    assert result.num_preemptions > 0


def test_a_long_idle_gap_is_skipped_and_changes_no_outcome():
    # Two identical requests a day apart: the second is served as the first was, and the day's
    # heartbeats and ticks are not simulated one by one.
    requests = [SimRequest(0.0, 32, 5), SimRequest(86_400.0, 32, 5)]
    sim = Simulation(Deployment(1, 1), profile())
    events = 0
    schedule = sim.at

    def counting(time: float, fn, *args: object) -> None:  # noqa: ANN001
        nonlocal events
        events += 1
        schedule(time, fn, *args)

    sim.at = counting
    result = sim.run(requests)
    first, second = result.outcomes
    assert second.success and second.arrival_s == 86_400.0
    assert (second.ttft_s, second.latency_s) == pytest.approx((first.ttft_s, first.latency_s))
    assert result.sim_seconds > 86_400.0
    assert events < 1_000  # a day of 0.1 s ticks alone would be 864,000


def test_a_run_stops_once_its_slo_attainment_cannot_be_met():
    # Far more than one node can prefill in time: most requests miss the TTFT target.
    workload = synthetic(200, LengthDist.parse("500"), LengthDist.parse("10"), seed=2)
    slo = SLO(ttft_s=0.05, tpot_s=1.0, attainment=0.9)
    p = profile(StepTimeModel(base_s=0.005, per_token_s=1e-4))
    _, stopped = run(Deployment(0, 1, colocated=True), workload.at_rate(50.0), p, slo)
    _, whole = run(Deployment(0, 1, colocated=True), workload.at_rate(50.0), p)
    assert stopped.stopped_early and not whole.stopped_early
    assert stopped.sim_seconds < whole.sim_seconds
    assert summarize(whole.outcomes, slo, 50.0).attainment < 0.9
    assert summarize(stopped.outcomes, slo, 50.0).attainment < 0.9


def test_a_simulated_run_is_summarized_from_its_first_arrival_to_its_last_end():
    outcomes = [
        Outcome(True, 0.0, 10, 0.2, 0.65),  # meets the SLO
        Outcome(True, 0.1, 1, 0.3, 0.3),  # meets it
        Outcome(True, 0.3, 40, 1.4, 2.0),  # too late a first token; the last end, at 2.3 s
        Outcome(False, 0.4, 0),
        Outcome(True, 0.5, 5, 0.1, 0.9),  # too slow after it
    ]
    summary = summarize(outcomes, SLO(1.0, 0.1), 2.0)
    assert summary.duration_s == pytest.approx(2.3)
    assert (summary.num_requests, summary.completed) == (5, 4)
    assert summary.attainment == pytest.approx(2 / 5)
    assert summary.goodput == pytest.approx(2 / 2.3)
    assert summary.throughput == pytest.approx(4 / 2.3)
    assert summary.ttft_ms["p50"] == pytest.approx(250.0)
    assert summary.tpot_ms["p50"] == pytest.approx(50.0)


def test_the_same_requests_at_another_rate_arrive_proportionally_sooner():
    workload = synthetic(50, LengthDist.parse("10:20"), LengthDist.parse("5"), seed=4)
    slow, fast = workload.at_rate(2.0), workload.at_rate(8.0)
    assert [r.prompt_len for r in slow] == [r.prompt_len for r in fast]
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 4)
    assert slow[0].arrival_s == 0.0 and math.isclose(
        sum(b.arrival_s - a.arrival_s for a, b in zip(slow, slow[1:])) / 49, 0.5, rel_tol=0.3
    )


def test_a_simulation_is_deterministic():
    workload = synthetic(40, LengthDist.parse("10:400"), LengthDist.parse("5:50"), seed=5)
    p = replace(profile(), hop_s=0.0003)
    a = run(Deployment(1, 2), workload.at_rate(20.0), p)[1].outcomes
    b = run(Deployment(1, 2), workload.at_rate(20.0), p)[1].outcomes
    assert a == b


def test_requests_with_their_own_times_are_a_workload_at_one_request_per_second():
    from pdserve.tune.workload import from_requests

    # Five requests at 8 per second (0.125 s apart): their own rate is 8, and at_rate says
    # requests per second as it does for a synthetic workload or a trace.
    given = [SimRequest(i * 0.125, 10, 5) for i in range(5)]
    w = from_requests(given, "five")
    assert w.trace_rate == pytest.approx(8.0)
    assert [r.arrival_s for r in w.at_rate(8.0)] == pytest.approx([0, 0.125, 0.25, 0.375, 0.5])
    assert [r.arrival_s for r in w.at_rate(2.0)] == pytest.approx([0, 0.5, 1.0, 1.5, 2.0])
