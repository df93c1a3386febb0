"""A windowed model served disaggregated, for real: a prefill node hands a Qwen2 checkpoint's KV
(one full layer, two layers with a 12-token window: three KV groups) to a decode node over tcp
and shm, and with a prefill node of two tensor-parallel ranks; every stream equals the offline
engine's (which equals transformers', test_windowed_models.py), the decode node receives only the
blocks its windowed layers will read, and every block comes back."""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.coordinator.metrics import Metrics
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BLOCK_SIZE, WINDOW, WINDOWED_GROUPS = 8, 12, 2


def blocks_moved(prompt_len: int) -> tuple[int, int]:
    """(blocks a handoff of this prompt moves, blocks it would move were every layer full):
    the full group's every block; each windowed group's from the one holding the first token
    the decode node's first query reads (position prompt_len - WINDOW + 1)."""
    whole = -(-prompt_len // BLOCK_SIZE)
    window = whole - max(0, prompt_len - WINDOW + 1) // BLOCK_SIZE
    return whole + WINDOWED_GROUPS * window, (1 + WINDOWED_GROUPS) * whole


CASES = [("tcp", 1), ("shm", 1), ("tcp", 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}-prefill-tp{n}" for t, n in CASES])
def served(request, checkpoint_dir):
    transport, prefill_tp = request.param
    model = str(checkpoint_dir("qwen2_sliding"))
    with Cluster(
        1,
        1,
        transport=transport,
        model=model,
        node_engines={"prefill-0": {"tensor_parallel_size": prefill_tp}},
        num_kv_blocks=160,
        block_size=BLOCK_SIZE,
    ) as cluster:
        yield cluster, LLM(model, num_kv_blocks=1024, block_size=BLOCK_SIZE, device="cpu")


def test_streams_equal_offline_and_only_the_windows_blocks_move(served):
    cluster, offline = served
    prompts = make_prompts(8, seed=37, lo=20, hi=90)  # up to 7 windows long
    expected = expected_outputs(offline, prompts, GREEDY)
    assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
    cluster.wait_until_idle()  # every block of both nodes free
    moved = sum(blocks_moved(len(p))[0] for p in prompts)
    every_layer_full = sum(blocks_moved(len(p))[1] for p in prompts)
    assert moved < every_layer_full
    node = cluster.wait_for_report(
        "decode-0", lambda n: n.kv_blocks_received >= moved, f"{moved} blocks received"
    )
    assert node.kv_blocks_received == moved
    # The bytes both nodes moved, on /metrics: a block holds a page of each slot of the pool.
    block_bytes = offline.engine.layout.bytes_per_block
    cluster.wait_for_report(
        "prefill-0", lambda n: n.kv_bytes_sent >= moved * block_bytes, "the bytes sent"
    )
    text = Metrics(cluster.coordinator).render().decode()
    for node_id, direction in (("prefill-0", "sent"), ("decode-0", "received")):
        line = f'pdserve_kv_transfer_bytes_total{{direction="{direction}",node="{node_id}"}}'
        (value,) = [ln.split()[-1] for ln in text.splitlines() if ln.startswith(line)]
        assert float(value) == moved * block_bytes
