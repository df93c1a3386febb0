"""Layer-wise KV streaming on a real cluster: long prompts are admitted into the decode node when
their prefill starts and their pages leave layer by layer; the streams are the offline engine's."""

from __future__ import annotations

import asyncio
import random

import pytest
from local_cluster import Cluster

from coordinator.client import CoordinatorClient
from coordinator.config import CoordinatorConfig
from coordinator.request_state import EarlyAdmission
from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
STREAMING = CoordinatorConfig(
    heartbeat_timeout_s=3.0, transfer_timeout_s=10.0, kv_streaming=True,
    kv_streaming_min_prompt_tokens=24,
)  # fmt: skip


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
