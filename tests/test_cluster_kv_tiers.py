"""KV tiers on a real cluster (1 prefill + 1 decode node, tiers on both): multi-turn chats
whose KV is several times either node's pool. Each turn's prompt is the last turn's prompt and
answer plus a new message; the pools have evicted it by then, the tiers have not. Every turn's
greedy output is the offline engine's token for token, both nodes load prefixes back from their
tiers (the prefill node for the prefill, the decode node instead of receiving them), and the
counters reach /metrics. Over tcp the host tiers hold everything; over shm a host tier of 16
blocks sits on a disk tier, which serves most of it. A windowed Qwen2's chats (three KV groups)
load every group's blocks back on both nodes, with the offline engine's tokens."""

from __future__ import annotations

import asyncio
import random

import pytest
from local_cluster import Cluster

from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.metrics import Metrics
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BLOCK = 8
POOL = 48  # blocks of 8 per node: 384 tokens
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # pdserve-tiny's: 2 layers, K and V, 2 heads of 16
CHATS, TURNS = 10, 3  # the last turns hold about 1,000 tokens of KV in all: 3x a pool


def conversation_turns(offline: LLM) -> list[list[tuple[list[int], list[int]]]]:
    """turns[t][c]: chat c's turn t as (prompt, offline answer)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(4, 500) for _ in range(40)] for _ in range(CHATS)]
    turns = []
    for _ in range(TURNS):
        answers = [o.token_ids for o in offline.generate(prompts, GREEDY)]
        turns.append(list(zip(prompts, answers)))
        prompts = [
            p + a + [rng.randrange(4, 500) for _ in range(12)] for p, a in zip(prompts, answers)
        ]
    return turns


@pytest.fixture(scope="module")
def turns() -> list[list[tuple[list[int], list[int]]]]:
    return conversation_turns(LLM(num_kv_blocks=1024, block_size=BLOCK))


def metric(text: str, name: str, node: str, tier: str) -> float:
    want = f'{name}{{node="{node}",tier="{tier}"}}'
    (line,) = [ln for ln in text.splitlines() if ln.startswith(want)]
    return float(line.split()[-1])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_multi_turn_chats_beyond_the_pools_match_offline_with_prefixes_from_tiers(
    transport, turns, tmp_path
):
    tiers = {"kv_host_bytes": 4 << 20}
    if transport == "shm":
        tiers = {"kv_host_bytes": 16 * BLOCK_BYTES, "kv_disk_path": str(tmp_path)}
    with Cluster(1, 1, transport=transport, num_kv_blocks=POOL, **tiers) as cluster:

        async def chat() -> None:
            async with CoordinatorClient(cluster.client_addr) as client:
                for t, turn in enumerate(turns):
                    for c, (prompt, answer) in enumerate(turn):
                        out, _ = await client.complete(prompt, GREEDY)
                        assert out == answer, (t, c)

        asyncio.run(chat())
        cluster.wait_until_idle()
        prefill, decode = cluster.node("prefill-0"), cluster.node("decode-0")
        lowest = "disk" if "kv_disk_path" in tiers else "host"
        for node in (prefill, decode):
            assert node.kv_tiers is not None and node.kv_tiers.failures == 0
            assert node.kv_tiers.blocks[lowest] > POOL  # more than its pool holds
        # Turns 2 and 3 (20 prompts of 68 and 96 tokens) found their earlier turns' blocks
        # below the pools: the prefill node prefilled from them, the decode node took them
        # instead of receiving them.
        assert sum(prefill.kv_tiers.hit_blocks.values()) >= 20 * 5
        assert sum(decode.kv_tiers.hit_blocks.values()) >= 20 * 5
        assert prefill.kv_tiers.hit_blocks[lowest] > 0 and decode.kv_tiers.hit_blocks[lowest] > 0
        # What came back was not computed again: the prefill node computed at most the prompts'
        # tokens less those blocks.
        prompt_tokens = sum(len(p) for turn in turns for p, _ in turn)
        hit_tokens = sum(prefill.kv_tiers.hit_blocks.values()) * BLOCK
        assert 0 < prefill.prefill_tokens_computed <= prompt_tokens - hit_tokens
        text = Metrics(cluster.coordinator).render().decode()
        assert (
            f'pdserve_prefill_tokens_computed_total{{node="prefill-0"}} {float(prefill.prefill_tokens_computed)}'
            in text
        )
        for node in (prefill, decode):
            hits = metric(text, "pdserve_kv_tier_hit_blocks_total", node.node_id, lowest)
            assert hits == node.kv_tiers.hit_blocks[lowest]
            loaded = metric(text, "pdserve_kv_tier_loaded_bytes_total", node.node_id, lowest)
            assert loaded == hits * BLOCK_BYTES


def test_a_windowed_model_s_chats_load_each_group_s_blocks_from_the_tiers_on_both_nodes(
    checkpoint_dir,
):
    """Qwen2 with one full layer and two 12-token windows (three KV groups): both nodes load
    every group's blocks back from their host tiers, and every turn is the offline engine's."""
    model = str(checkpoint_dir("qwen2_sliding"))
    turns = conversation_turns(LLM(model, num_kv_blocks=1024, block_size=BLOCK, device="cpu"))
    with Cluster(
        1, 1, model=model, num_kv_blocks=64, block_size=BLOCK, kv_host_bytes=4 << 20
    ) as cluster:

        async def chat() -> None:
            async with CoordinatorClient(cluster.client_addr) as client:
                for t, turn in enumerate(turns):
                    for c, (prompt, answer) in enumerate(turn):
                        out, _ = await client.complete(prompt, GREEDY)
                        assert out == answer, (t, c)

        asyncio.run(chat())
        cluster.wait_until_idle()
        prefill, decode = cluster.node("prefill-0"), cluster.node("decode-0")
        for node in (prefill, decode):
            assert node.kv_tiers is not None and node.kv_tiers.failures == 0
            assert node.kv_tiers.hit_blocks["host"] > 0
        prompt_tokens = sum(len(p) for turn in turns for p, _ in turn)
        assert 0 < prefill.prefill_tokens_computed < prompt_tokens
