"""Layer-wise KV streaming on a real cluster: long prompts are admitted into the decode node when
their prefill starts and their pages leave layer by layer; the streams are the offline engine's."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from local_cluster import Cluster

from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.request_state import EarlyAdmission
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
STREAMING = CoordinatorConfig(
    heartbeat_timeout_s=3.0,
    transfer_timeout_s=10.0,
    kv_streaming=True,
    kv_streaming_min_prompt_tokens=24,
)


def make_prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(num_kv_blocks=1024, block_size=8)


async def run_all(addr: str, prompts, params) -> list[tuple[list[int], str]]:
    async with CoordinatorClient(addr) as client:
        return await asyncio.gather(*(client.complete(p, params) for p in prompts))


def watch_admissions(cluster: Cluster) -> list[EarlyAdmission]:
    """How each request's first attempt was admitted, as it got its first token."""
    seen: list[EarlyAdmission] = []
    cluster.coordinator.listeners.append(
        lambda name, s: seen.append(s.early) if name == "first_token" else None
    )
    return seen


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_streamed_handoffs_match_offline_including_chunked_prefills(transport, offline):
    # max_num_batched_tokens=32: the prompts over 32 tokens prefill in chunks, and only their
    # last chunk's forward streams (each layer's send carries every chunk's pages of it).
    # One prompt fills its blocks exactly (48 tokens): its first token needs a block of its own.
    prompts = make_prompts(5, seed=7, lo=24, hi=90) + make_prompts(2, seed=8, lo=3, hi=12)
    prompts.append(list(range(100, 148)))
    expected = [o.token_ids for o in offline.generate(prompts, GREEDY)]
    with Cluster(1, 1, transport=transport, config=STREAMING, max_num_batched_tokens=32) as cluster:
        admissions = watch_admissions(cluster)
        results = asyncio.run(run_all(cluster.client_addr, prompts, GREEDY))
        assert [tokens for tokens, _ in results] == expected
        assert (
            admissions.count(EarlyAdmission.ADMITTED) + admissions.count(EarlyAdmission.ADMITTING)
            >= 6
        )  # every long prompt was admitted early
        assert admissions.count(EarlyAdmission.NONE) >= 2  # the short ones were not
        cluster.wait_until_idle()  # every block free on both nodes


def wait_for(predicate, timeout_s: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def admitted_mid_prefill(cluster: Cluster, request_id: str):  # noqa: ANN201
    """The request's state once its decode node reserved blocks while its prefill still runs."""
    found = []

    def check() -> bool:
        state = cluster.coordinator.core.requests.get(request_id)
        if state is not None and state.early is EarlyAdmission.ADMITTED:
            found.append(state)
        return bool(found)

    wait_for(check)
    return found[0]


# 900 tokens in chunks of 16: the prefill runs for dozens of steps after its admission.
LONG_PROMPT = [4 + (i * 37) % 490 for i in range(900)]


def test_an_abort_mid_prefill_after_admission_frees_every_block_on_both_nodes():
    with Cluster(1, 1, config=STREAMING, max_num_batched_tokens=16) as cluster:
        prefill = cluster.group.procs["prefill-0"]

        async def abort_mid_prefill() -> None:
            async with CoordinatorClient(cluster.client_addr) as client:
                stream = client.generate(LONG_PROMPT, GREEDY, request_id="long-1")
                first = asyncio.ensure_future(stream.__anext__())  # submits it
                state = await asyncio.to_thread(admitted_mid_prefill, cluster, "long-1")
                os.kill(prefill.pid, signal.SIGSTOP)  # hold the prefill where it is
                try:
                    assert state.first_token_at is None  # no token yet: mid-prefill
                    await client.abort("long-1")
                    await asyncio.to_thread(
                        wait_for, lambda: "long-1" not in cluster.coordinator.core.requests
                    )
                finally:
                    os.kill(prefill.pid, signal.SIGCONT)
                first.cancel()

        asyncio.run(abort_mid_prefill())
        # Both nodes report every block free: the decode node's reservation and the prefill
        # node's prompt (and any pages it had started to send).
        cluster.wait_until_idle()
        tokens, _ = asyncio.run(run_all(cluster.client_addr, [LONG_PROMPT[:40]], GREEDY))[0]
        assert len(tokens) == GREEDY.max_tokens  # and it serves on


def test_a_prefill_node_killed_after_admission_fails_over_and_finishes_identical(offline):
    # The kill lands mid-prefill with the route known (not deterministically mid-send: the
    # handoff-level test_kv_streaming covers a sender lost after some layers).
    (expected,) = [o.token_ids for o in offline.generate([LONG_PROMPT], GREEDY)]
    with Cluster(2, 1, config=STREAMING, max_num_batched_tokens=16) as cluster:

        async def run_with_kill() -> tuple[list[int], str]:
            async with CoordinatorClient(cluster.client_addr) as client:
                tokens: list[int] = []
                stream = client.generate(LONG_PROMPT, GREEDY, request_id="long-2")
                first = asyncio.ensure_future(stream.__anext__())
                state = await asyncio.to_thread(admitted_mid_prefill, cluster, "long-2")
                victim = state.prefill_node
                await asyncio.to_thread(cluster.kill, victim)
                tokens += (await first).token_ids
                async for event in stream:
                    tokens += event.token_ids
                return tokens, victim

        tokens, victim = asyncio.run(run_with_kill())
        assert tokens == expected
        assert not cluster.node(victim).alive
        cluster.wait_until_idle()


def test_a_tensor_parallel_prefill_node_streams_its_layers_from_every_rank(offline):
    # Every rank sends its heads of a layer once its own forward has that layer (the send is
    # ordered as rank 0's layer ends and held by the other rank's worker until its own does),
    # into the reservation made when the prefill started.
    prompts = make_prompts(4, seed=9, lo=24, hi=70)
    expected = [o.token_ids for o in offline.generate(prompts, GREEDY)]
    tp2 = {"prefill-0": {"tensor_parallel_size": 2}}
    with Cluster(1, 1, config=STREAMING, node_engines=tp2, max_num_batched_tokens=32) as cluster:
        admissions = watch_admissions(cluster)
        results = asyncio.run(run_all(cluster.client_addr, prompts, GREEDY))
        assert [tokens for tokens, _ in results] == expected
        assert EarlyAdmission.NONE not in admissions
        cluster.wait_until_idle()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_streamed_second_turn_receives_only_the_blocks_the_decode_node_lacks(transport, offline):
    # Both turns stream (over 24 tokens) and decode-side prefix reuse is on: turn 2's early
    # admission finds turn 1's prompt and answer cached on the decode node, and its layers carry
    # only the blocks after them.
    rng = random.Random(3)
    turn1 = [rng.randrange(4, 500) for _ in range(29)]
    (answer1,) = [o.token_ids for o in offline.generate([turn1], GREEDY)]
    turn2 = turn1 + answer1 + [rng.randrange(4, 500) for _ in range(13)]  # 54 tokens, 7 blocks
    (answer2,) = [o.token_ids for o in offline.generate([turn2], GREEDY)]
    with Cluster(1, 1, transport=transport, config=STREAMING) as cluster:
        admissions = watch_admissions(cluster)
        for prompt, answer in ((turn1, answer1), (turn2, answer2)):
            ((tokens, _),) = asyncio.run(run_all(cluster.client_addr, [prompt], GREEDY))
            assert tokens == answer
        assert EarlyAdmission.NONE not in admissions
        # Turn 1: 4 blocks received. It left 40 tokens of KV (29 + 11 of its 12 answer tokens)
        # on the decode node: 5 full blocks of turn 2's 7 are reused, 2 received.
        node = cluster.node("decode-0")
        wait_for(lambda: (node.kv_blocks_received, node.kv_blocks_reused) == (4 + 2, 5), 20.0)
        cluster.wait_until_idle()
