"""Decode-side prefix reuse on a real cluster (1 prefill + 1 decode node): a chat's second turn,
whose prompt is the first turn's prompt and answer plus a new message, finds the first turn's
blocks cached on the decode node and receives only the rest, and its greedy output is the
offline engine's token for token. The node's counters reach /metrics."""

from __future__ import annotations

import asyncio
import time

import pytest
from local_cluster import Cluster, complete
from local_cluster import random_tokens as tokens

from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.metrics import Metrics
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BLOCK = 8  # the test cluster's block size


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(num_kv_blocks=1024, block_size=BLOCK)


def reported(cluster: Cluster, expected: tuple[int, int]) -> tuple[int, int]:
    """Wait (bounded: a report comes every 0.2 s) until the decode node reports `expected` as
    its (blocks received, blocks reused); a report sent mid-handoff may lag behind."""
    node = cluster.node("decode-0")
    for _ in range(100):
        now = (node.kv_blocks_received, node.kv_blocks_reused)
        if now == expected:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the decode node reports {now}, not {expected}")


def metric(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + '{node="decode-0"}')]
    return float(line.split()[-1])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_second_turn_reuses_the_first_turn_s_blocks_and_matches_offline(transport, offline):
    turn1 = tokens(29, seed=1)
    (answer1,) = [o.token_ids for o in offline.generate([turn1], GREEDY)]
    turn2 = turn1 + answer1 + tokens(13, seed=2)  # 58 tokens: 7 full blocks and a partial one
    (answer2,) = [o.token_ids for o in offline.generate([turn2], GREEDY)]
    with Cluster(1, 1, transport=transport) as cluster:
        assert complete(cluster, turn1, GREEDY) == answer1
        reported(cluster, (4, 0))  # 29 tokens: 4 blocks received, nothing cached yet
        assert complete(cluster, turn2, GREEDY) == answer2
        # Turn 1's prompt and answer left 44 tokens of KV on the decode node: 5 full blocks of
        # turn 2's 8 are reused, 3 received.
        received, reused = reported(cluster, (4 + 3, 5))
        text = Metrics(cluster.coordinator).render().decode()
        assert metric(text, "pdserve_kv_transfer_blocks_total") == received
        assert metric(text, "pdserve_kv_transfer_blocks_reused_total") == reused
        cluster.wait_until_idle()


def test_abort_after_admission_frees_both_sides_and_reuse_off_sends_every_block(offline):
    turn1 = tokens(29, seed=3)
    (answer1,) = [o.token_ids for o in offline.generate([turn1], GREEDY)]
    turn2 = turn1 + answer1 + tokens(13, seed=4)
    (answer2,) = [o.token_ids for o in offline.generate([turn2], GREEDY)]
    with Cluster(1, 1, transport="tcp") as cluster:
        assert complete(cluster, turn1, GREEDY) == answer1
        reported(cluster, (4, 0))

        async def abort_turn2() -> int:
            async with CoordinatorClient(cluster.client_addr) as client:
                long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
                received = 0
                async for event in client.generate(turn2, long):
                    received += len(event.token_ids)
                    if received >= 3:
                        break  # leaving the stream aborts the request everywhere
                return received

        # Admitted with 5 reused blocks, decoding on the decode node, then aborted.
        assert asyncio.run(abort_turn2()) >= 3
        reported(cluster, (4 + 3, 5))
        cluster.wait_until_idle()  # every block back on both nodes
        # The switch off (it is live): every block is sent, none reused, same output.
        cluster.loop_call(lambda: setattr(cluster.coordinator.config, "decode_prefix_reuse", False))
        assert complete(cluster, turn2, GREEDY) == answer2
        reported(cluster, (4 + 3 + 8, 5))
        cluster.wait_until_idle()
