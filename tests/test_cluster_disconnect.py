"""A node process killed outright closes its connections to the coordinator, which are never
made again: the coordinator names the node whose connection closed and finds it dead
disconnect_grace_s later, not after heartbeat_timeout_s (set to a minute here, so only its
connection's close can explain a quick failover), and its requests stream on elsewhere with the
offline engine's tokens."""

from __future__ import annotations

import asyncio
import time

import pytest
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts

from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

PARAMS = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


def test_a_killed_decode_node_is_found_by_its_connection_s_close_not_the_heartbeat_timeout():
    prompts = make_prompts(6, seed=51, lo=5, hi=40)
    expected = expected_outputs(LLM(num_kv_blocks=1024, block_size=8), prompts, PARAMS)
    config = CoordinatorConfig(heartbeat_timeout_s=60.0)  # disconnect_grace_s: its default
    with Cluster(1, 2, config=config) as cluster:
        found: list[float] = []

        async def run() -> list[list[int]]:
            async with CoordinatorClient(cluster.client_addr) as client:
                tasks = [asyncio.create_task(client.complete(p, PARAMS)) for p in prompts]
                await cluster.kill_mid_output("decode-0")
                killed = time.monotonic()
                node = cluster.coordinator.nodes.nodes["decode-0"]
                while node.alive and time.monotonic() - killed < 20.0:
                    await asyncio.sleep(0.01)
                found.append(time.monotonic() - killed)
                return [tokens for tokens, _ in await asyncio.gather(*tasks)]

        assert asyncio.run(run()) == expected
        # The grace, then the coordinator's next tick (0.1 s); a loaded machine's delays beside.
        # The clock starts once kill_mid_output has reaped the process, which may be a few tens of
        # milliseconds after its connection closed and the grace began.
        grace = config.disconnect_grace_s
        assert grace - 0.1 <= found[0] < grace + 1.0, f"decode-0 found dead {found[0]:.2f} s after"
        assert cluster.coordinator.nodes.nodes["decode-1"].alive
        cluster.wait_until_idle()
