"""The disaggregated cluster for real: a coordinator, prefill and decode node processes, KV pages
over real transports, clients over real sockets, on CPU."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
import zmq
import zmq.asyncio
from junk_frames import JUNK
from local_cluster import Cluster

from pdserve.cluster.keys import curve_client
from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import SubmitError
from pdserve.coordinator.request_state import Phase
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def make_prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(num_kv_blocks=1024, block_size=8)


def expected_outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


async def run_all(addr: str, prompts, params) -> list[tuple[list[int], str]]:
    async with CoordinatorClient(addr) as client:
        return await asyncio.gather(*(client.complete(p, params) for p in prompts))


@pytest.mark.parametrize(
    "transport,kv_handoff",
    [("tcp", "immediate"), ("shm", "immediate"), ("tcp", "between-steps")],
)
def test_one_prefill_one_decode_matches_offline(transport, kv_handoff, offline):
    prompts = make_prompts(8, seed=1)
    expected = expected_outputs(offline, prompts, GREEDY)
    # A seeded sampled request: its first token is drawn on the prefill node, the rest on the
    # decode node, whose noise is keyed by each token's index in the request's outputs, so the
    # stream is the offline one.
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    (expected_seeded,) = expected_outputs(offline, prompts[:1], seeded)
    with Cluster(1, 1, transport=transport, kv_handoff=kv_handoff) as cluster:

        async def both() -> tuple[list, tuple]:
            return await asyncio.gather(
                run_all(cluster.client_addr, prompts, GREEDY),
                run_all(cluster.client_addr, prompts[:1], seeded),
            )

        results, (seeded_result,) = asyncio.run(both())
        assert [tokens for tokens, _ in results] == expected
        assert all(reason == "length" for _, reason in results)
        assert seeded_result[0] == expected_seeded
        cluster.wait_until_idle()
        # Immediate: the handoff socket announced itself, and SendKV went there from then on.
        handoff = cluster.coordinator.handoff_identities
        assert ("prefill-0" in handoff) == (kv_handoff == "immediate")


def test_short_prompts_are_prefilled_on_the_decode_node(offline):
    # Conditional disaggregation: below the threshold, no prefill node is involved.
    config = CoordinatorConfig(conditional_disagg_threshold=20)
    prompts = make_prompts(4, seed=2, lo=3, hi=10) + make_prompts(2, seed=3, lo=30, hi=50)
    expected = expected_outputs(offline, prompts, GREEDY)
    with Cluster(1, 1, config=config) as cluster:
        routes = []
        cluster.coordinator.listeners.append(
            lambda name, s: (
                routes.append((len(s.prompt_token_ids), s.phase)) if name == "submitted" else None
            )
        )
        results = asyncio.run(run_all(cluster.client_addr, prompts, GREEDY))
        assert [tokens for tokens, _ in results] == expected
        for length, phase in routes:
            assert phase is (Phase.LOCAL_PREFILL if length < 20 else Phase.PREFILLING)
        cluster.wait_until_idle()


def test_abort_mid_stream_frees_blocks_on_both_nodes_and_flood_is_refused():
    config = CoordinatorConfig(max_pending_requests=3)
    with Cluster(1, 1, config=config, max_num_batched_tokens=64) as cluster:

        async def abort_after_tokens() -> int:
            async with CoordinatorClient(cluster.client_addr) as client:
                long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
                received = 0
                async for event in client.generate(list(range(10, 50)), long):
                    received += len(event.token_ids)
                    if received >= 5:
                        break  # leaving the stream aborts the request everywhere
                return received

        assert asyncio.run(abort_after_tokens()) >= 5
        cluster.wait_until_idle()

        async def flood() -> tuple[int, int]:
            async with CoordinatorClient(cluster.client_addr) as client:
                prompts = make_prompts(40, seed=4, lo=40, hi=60)

                async def one(p):  # noqa: ANN001, ANN202
                    try:
                        await client.complete(p, GREEDY)
                        return "ok"
                    except SubmitError as exc:
                        return exc.code

                codes = await asyncio.gather(*(one(p) for p in prompts))
                return codes.count("ok"), codes.count("overloaded")

        ok, overloaded = asyncio.run(flood())
        assert ok >= 3 and overloaded > 0 and ok + overloaded == 40
        cluster.wait_until_idle()
        tokens, _ = asyncio.run(run_all(cluster.client_addr, [[5, 6, 7]], GREEDY))[0]
        assert len(tokens) == 16  # still healthy


def test_junk_to_every_port_is_dropped_and_the_cluster_serves_on():
    with Cluster(1, 1) as cluster:
        coordinator = cluster.coordinator
        handoff = coordinator.handoff_identities["prefill-0"]
        kv_address = cluster.node("decode-0").receiver_info["address"]

        async def junk() -> None:
            # coordinator -> each node's main socket and the prefill node's handoff socket
            identities = [n.identity for n in coordinator.nodes.alive()] + [handoff]
            for identity in identities:
                for frames in JUNK:
                    await coordinator.node_sock.send_multipart([identity, *frames])
            # a member gone wrong (it holds the cluster keys) -> the coordinator's node and client
            # ports, and the decode node's KV port
            ctx = zmq.asyncio.Context.instance()
            for endpoint in (coordinator.node_endpoint, coordinator.client_endpoint, kv_address):
                sock = ctx.socket(zmq.DEALER)
                curve_client(sock, cluster.keys)
                sock.connect(endpoint)
                for frames in JUNK:
                    await sock.send_multipart(frames)
                sock.close(linger=5000)  # after what it queued has gone out

        cluster.call(junk())
        # The coordinator has read every one (all but the stranger's Heartbeat are malformed).
        deadline = time.monotonic() + 30
        while coordinator._malformed_nodes.total + coordinator._malformed_clients.total < 2 * (
            len(JUNK) - 1
        ):
            assert time.monotonic() < deadline, "the coordinator never read the junk"
            time.sleep(0.05)
        prompts = make_prompts(3, seed=8)
        results = asyncio.run(run_all(cluster.client_addr, prompts, GREEDY))
        assert all(len(tokens) == 16 for tokens, _ in results)
        assert all(p.poll() is None for p in cluster.group.procs.values())
        assert not coordinator.failed.is_set()
        cluster.wait_until_idle()


class TestTwoByTwo:
    """2 prefill + 2 decode nodes; the last test kills a decode node."""

    @pytest.fixture(scope="class")
    @classmethod
    def cluster(cls):
        with Cluster(2, 2, num_kv_blocks=160) as cluster:
            yield cluster

    def test_64_concurrent_requests_complete_and_free_every_block(self, cluster, offline):
        prompts = make_prompts(64, seed=5, lo=3, hi=40)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        expected = expected_outputs(offline, prompts, params)
        results = asyncio.run(run_all(cluster.client_addr, prompts, params))
        assert [t for t, _ in results] == expected
        cluster.wait_until_idle()
        used = {n.node_id for n in cluster.coordinator.nodes.alive()}
        assert used == {"prefill-0", "prefill-1", "decode-0", "decode-1"}

    def test_prefix_affinity_keeps_a_shared_prefix_on_one_prefill_node(self, cluster):
        shared = list(range(100, 164))  # 8 full blocks of 8
        chosen = []
        listener = lambda name, s: chosen.append(s.prefill_node) if name == "submitted" else None  # noqa: E731
        cluster.coordinator.listeners.append(listener)
        hits_before = {n: cluster.node(n).prefix_hits for n in ("prefill-0", "prefill-1")}

        def reported() -> bool:
            return all(cluster.node(n).prefill_load == 0 for n in hits_before)

        async def sequentially() -> None:
            async with CoordinatorClient(cluster.client_addr) as client:
                for i in range(6):
                    await client.complete(shared + [200 + i, 300 + i], GREEDY)
                    # Until the nodes' load reports say their queues are empty: a report sent
                    # while the last prompt was queued counts it as load (66 tokens, more than
                    # the 64 a cached prefix saves), and the next request would rightly go to
                    # the idler node.
                    deadline = time.monotonic() + 30
                    while not reported():
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.02)

        asyncio.run(sequentially())
        cluster.coordinator.listeners.remove(listener)
        assert len(set(chosen)) == 1
        node = chosen[0]
        deadline = time.monotonic() + 30  # until a heartbeat carries the counters
        while cluster.node(node).prefix_hits - hits_before[node] < 5 * 8:
            assert time.monotonic() < deadline, cluster.node(node).prefix_hits
            time.sleep(0.05)

    def test_a_node_wrongly_declared_dead_is_reset_and_rejoins(self, cluster, offline):
        prompts = make_prompts(6, seed=7, lo=5, hi=30)
        params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
        expected = expected_outputs(offline, prompts, params)
        coordinator = cluster.coordinator

        async def run() -> list[list[int]]:
            async with CoordinatorClient(cluster.client_addr) as client:
                tasks = [asyncio.create_task(client.complete(p, params)) for p in prompts]
                while not any(
                    s.decode_node == "decode-1" and s.phase is Phase.DECODING
                    for s in list(coordinator.requests.values())
                ):
                    await asyncio.sleep(0.005)
                cluster.loop_call(lambda: coordinator.declare_dead("decode-1"))
                return [tokens for tokens, _ in await asyncio.gather(*tasks)]

        assert asyncio.run(run()) == expected
        deadline = time.monotonic() + 20
        while not cluster.node("decode-1").alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.node("decode-1").alive  # it was reset and registered again
        cluster.wait_until_idle()

    def test_a_frozen_then_killed_prefill_node_s_requests_are_prefilled_elsewhere(
        self, cluster, offline
    ):
        prompts = make_prompts(8, seed=9, lo=20, hi=40)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        expected = expected_outputs(offline, prompts, params)
        routed = []
        listener = lambda name, s: routed.append(s.prefill_node) if name == "submitted" else None  # noqa: E731
        cluster.coordinator.listeners.append(listener)
        victim = cluster.group.procs["prefill-1"]
        os.kill(victim.pid, signal.SIGSTOP)  # silent from now on, its sockets still open
        try:
            results = asyncio.run(run_all(cluster.client_addr, prompts, params))
        finally:
            cluster.coordinator.listeners.remove(listener)
            cluster.kill("prefill-1")
        assert "prefill-1" in routed  # some went to it before it was declared dead
        assert [tokens for tokens, _ in results] == expected
        assert not cluster.node("prefill-1").alive
        cluster.wait_until_idle()

    def test_killed_decode_node_requests_finish_elsewhere_without_gaps(self, cluster, offline):
        prompts = make_prompts(10, seed=6, lo=5, hi=30)
        # The penalty counts the outputs streamed before the retry as the resumed stream's own.
        params = SamplingParams(
            max_tokens=150, temperature=0, ignore_eos=True, frequency_penalty=0.4
        )
        expected = expected_outputs(offline, prompts, params)

        async def run_with_kill() -> list[list[int]]:
            async with CoordinatorClient(cluster.client_addr) as client:
                tasks = [asyncio.create_task(client.complete(p, params)) for p in prompts]
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    holding = [
                        s
                        for s in list(cluster.coordinator.requests.values())
                        if s.decode_node == "decode-0"
                        and s.phase is Phase.DECODING
                        and len(s.output_token_ids) >= 3
                    ]
                    if holding:
                        break
                    await asyncio.sleep(0.005)
                assert holding, "decode-0 never held a running request"
                cluster.kill("decode-0")
                results = await asyncio.gather(*tasks)
                return [tokens for tokens, _ in results]

        assert asyncio.run(run_with_kill()) == expected
        cluster.wait_until_idle()
        assert not cluster.node("decode-0").alive
