"""The prefix index on a real cluster over tcp (1 prefill + 2 decode nodes): the nodes' KV events
tell the coordinator which decode node holds a conversation's first turn (as /metrics shows); the
second turn is admitted there and reuses those blocks; with placement by uncached tokens on, the
third turn, mostly cached there, is prefilled there with no handoff. Outputs match offline."""

from __future__ import annotations

import time

import pytest
from local_cluster import Cluster, complete
from local_cluster import random_tokens as tokens

from pdserve.cluster.block_hash import prefix_hashes
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.metrics import Metrics
from pdserve.coordinator.request_state import Phase, RequestState
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BLOCK = 8  # the test cluster's block size
DECODERS = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(num_kv_blocks=1024, block_size=BLOCK)


def index_blocks(cluster: Cluster) -> dict[str, float]:
    """pdserve_prefix_index_blocks{tier="device"} by node, as /metrics serves it."""
    text = Metrics(cluster.coordinator).render().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("pdserve_prefix_index_blocks{") and 'tier="device"' in line:
            node = line.split('node="')[1].split('"')[0]
            found[node] = float(line.split()[-1])
    return found


def wait_for_index(cluster: Cluster, node_id: str, blocks: int) -> dict[str, float]:
    """Until /metrics says the node holds `blocks` device blocks (its next load reports carry
    its KV events: one every 0.2 s)."""
    for _ in range(100):
        found = index_blocks(cluster)
        if found.get(node_id) == blocks:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the index holds {found}, not {blocks} blocks on {node_id}")


def test_a_second_turn_goes_to_the_decode_node_whose_kv_events_hold_the_first(offline):
    turn1 = tokens(29, seed=5)
    (answer1,) = [o.token_ids for o in offline.generate([turn1], GREEDY)]
    turn2 = turn1 + answer1 + tokens(13, seed=6)  # 58 tokens
    (answer2,) = [o.token_ids for o in offline.generate([turn2], GREEDY)]
    turn3 = turn2 + answer2 + tokens(5, seed=7)  # 79 tokens: 73 of them cached after turn 2
    (answer3,) = [o.token_ids for o in offline.generate([turn3], GREEDY)]
    config = CoordinatorConfig(heartbeat_timeout_s=3.0, transfer_timeout_s=10.0)
    with Cluster(1, 2, transport="tcp", config=config) as cluster:
        routed: list[tuple[Phase, str | None]] = []

        def observe(name: str, state: RequestState) -> None:
            if name == "routed":
                routed.append((state.phase, state.decode_node))
            elif name == "phase" and state.phase is Phase.ADMITTING:
                routed.append((state.phase, state.decode_node))

        cluster.loop_call(lambda: cluster.coordinator.listeners.append(observe))
        assert complete(cluster, turn1, GREEDY) == answer1
        (holder,) = {node for phase, node in routed if phase is Phase.ADMITTING}
        other = next(n for n in DECODERS if n != holder)
        # Turn 1's prompt and answer (44 tokens of KV) left 5 full blocks on the holder, by its
        # KV events; the other decode node holds none.
        found = wait_for_index(cluster, holder, 5)
        assert found.get(other, 0) == 0
        index = cluster.coordinator.core.prefix_index
        assert index.match(holder, prefix_hashes(turn2, BLOCK)).blocks == 5
        routed.clear()
        assert complete(cluster, turn2, GREEDY) == answer2
        assert [node for phase, node in routed if phase is Phase.ADMITTING] == [holder]
        assert cluster.node(holder).kv_blocks_reused in (0, 5)  # its next report says 5
        # Placement by uncached tokens (a live setting): turn 3 is 73 of 79 tokens cached on
        # the holder: prefilled there, no prefill node, no handoff.
        wait_for_index(cluster, holder, 9)  # turn 2's 74 tokens of KV: 9 full blocks
        cluster.loop_call(
            lambda: setattr(cluster.coordinator.config, "local_prefill_max_uncached_tokens", 16)
        )
        routed.clear()
        assert complete(cluster, turn3, GREEDY) == answer3
        assert routed == [(Phase.LOCAL_PREFILL, holder)]
        cluster.wait_until_idle()
