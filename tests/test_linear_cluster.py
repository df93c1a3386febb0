"""Linear-attention hybrids served disaggregated, for real: a prefill node hands a Qwen3.5
checkpoint's KV (its full-attention layers' pages) and its Gated DeltaNet layers' states (one
block per linear group, whatever the prompt's length) to a decode node over tcp and shm, and
between nodes of unequal tensor-parallel sizes (the states re-split by heads as pages are);
every stream equals the offline engine's (which equals transformers', test_qwen3_next.py), a
chat's second turn restores a state snapshot on both roles, a decode node killed mid-output
changes no token, layer-wise streaming sends each state once its layer has done the last chunk,
and `pdserve serve DIR` of each hybrid family answers with transformers' greedy text."""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster, complete
from local_cluster import random_tokens as tokens
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.coordinator.client import CoordinatorClient
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONGER = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BLOCK_SIZE = 8  # asked for; the nodes raise it until a page holds a linear layer's state
FAMILY = "qwen3_5_text"


def offline_llm(model: str) -> LLM:
    return LLM(model, num_kv_blocks=1024, block_size=BLOCK_SIZE, device="cpu")


def blocks_moved(offline: LLM, prompt_len: int) -> tuple[int, int]:
    """(blocks a handoff of this prompt moves, blocks it would move were every layer full
    attention): each full group's every block, one state block per linear group."""
    layout = offline.engine.layout
    groups = layout.groups.groups
    whole = -(-prompt_len // layout.block_size)
    full = sum(1 for g in groups if g.kind.label == "full")
    linear = sum(1 for g in groups if g.kind.label == "linear")
    assert full and linear
    return full * whole + linear, (full + linear) * whole


# tcp between nodes of one rank each: the tests below (the default transport).
CASES = [
    ("shm", 1, 1),
    ("tcp", 2, 1),
    ("tcp", 1, 2),
]


@pytest.fixture(
    scope="module", params=CASES, ids=[f"{t}-prefill-tp{p}-decode-tp{d}" for t, p, d in CASES]
)
def served(request, checkpoint_dir):
    transport, prefill_tp, decode_tp = request.param
    model = str(checkpoint_dir(FAMILY))
    with Cluster(
        1,
        1,
        transport=transport,
        model=model,
        node_engines={
            "prefill-0": {"tensor_parallel_size": prefill_tp},
            "decode-0": {"tensor_parallel_size": decode_tp},
        },
        num_kv_blocks=160,
        block_size=BLOCK_SIZE,
    ) as cluster:
        yield cluster, offline_llm(model)


def test_streams_equal_offline_and_each_state_moves_once(served):
    cluster, offline = served
    assert offline.engine.layout.block_size > BLOCK_SIZE  # raised to hold a state
    prompts = make_prompts(8, seed=37, lo=20, hi=120)  # up to 5 blocks
    expected = expected_outputs(offline, prompts, GREEDY)
    assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
    cluster.wait_until_idle()  # every block of both nodes free
    moved = sum(blocks_moved(offline, len(p))[0] for p in prompts)
    every_layer_full = sum(blocks_moved(offline, len(p))[1] for p in prompts)
    assert moved < every_layer_full
    node = cluster.wait_for_report(
        "decode-0", lambda n: n.kv_blocks_received >= moved, f"{moved} blocks received"
    )
    assert node.kv_blocks_received == moved


def test_a_second_turn_restores_a_state_snapshot_on_both_roles(checkpoint_dir):
    model = str(checkpoint_dir(FAMILY))
    offline = offline_llm(model)
    bs = offline.engine.layout.block_size
    turn1 = tokens(3 * bs + 5, seed=1)
    (answer1,) = [o.token_ids for o in offline.generate([turn1], LONGER)]
    turn2 = turn1 + answer1 + tokens(bs, seed=2)
    (answer2,) = [o.token_ids for o in offline.generate([turn2], LONGER)]
    with Cluster(1, 1, model=model, num_kv_blocks=160, block_size=BLOCK_SIZE) as cluster:
        assert complete(cluster, turn1, LONGER) == answer1
        first = blocks_moved(offline, len(turn1))[0]
        cluster.wait_for_report("decode-0", lambda n: n.kv_blocks_received == first, "turn 1")
        prefill_hits = cluster.wait_for_report("prefill-0", lambda n: True, "a report")
        hits_before = prefill_hits.prefix_hits
        assert complete(cluster, turn2, LONGER) == answer2
        # Turn 1 left a state at every block boundary it computed, on both nodes: the prompt's
        # on the prefill node, the prompt's and its decoded tokens' on the decode node.
        reused = (len(turn1) + len(answer1) - 1) // bs
        node = cluster.wait_for_report(
            "decode-0", lambda n: n.kv_blocks_reused == reused, f"{reused} reused blocks"
        )
        assert node.kv_blocks_received > first
        prefill = cluster.wait_for_report(
            "prefill-0", lambda n: n.prefix_hits > hits_before, "turn 2's prefix hit"
        )
        assert prefill.prefix_hits - hits_before >= (len(turn1) - 1) // bs
        cluster.wait_until_idle()


def test_a_decode_node_killed_mid_output_changes_no_token(checkpoint_dir):
    model = str(checkpoint_dir(FAMILY))
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    prompts = make_prompts(4, seed=51, lo=10, hi=60)
    expected = expected_outputs(offline_llm(model), prompts, params)
    with Cluster(1, 2, model=model, num_kv_blocks=160, block_size=BLOCK_SIZE) as cluster:

        async def run() -> list[list[int]]:
            async with CoordinatorClient(cluster.client_addr) as client:
                tasks = [asyncio.create_task(client.complete(p, params)) for p in prompts]
                await cluster.kill_mid_output("decode-0")
                return [out for out, _ in await asyncio.gather(*tasks)]

        assert asyncio.run(run()) == expected
        cluster.wait_until_idle()


def test_layer_wise_streaming_sends_each_state_once_its_layer_is_done(checkpoint_dir):
    from pdserve.coordinator.config import CoordinatorConfig

    model = str(checkpoint_dir(FAMILY))
    offline = offline_llm(model)
    streaming = CoordinatorConfig(
        heartbeat_timeout_s=3.0,
        transfer_timeout_s=10.0,
        kv_streaming=True,
        kv_streaming_min_prompt_tokens=24,
    )
    prompts = make_prompts(5, seed=43, lo=40, hi=120)
    expected = expected_outputs(offline, prompts, GREEDY)
    with Cluster(
        1,
        1,
        model=model,
        config=streaming,
        num_kv_blocks=160,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=29,  # prompts prefill in chunks that end inside blocks
    ) as cluster:
        assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
        cluster.wait_until_idle()
        moved = sum(blocks_moved(offline, len(p))[0] for p in prompts)
        node = cluster.wait_for_report(
            "decode-0", lambda n: n.kv_blocks_received >= moved, f"{moved} blocks received"
        )
        assert node.kv_blocks_received == moved


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_pdserve_serve_answers_over_http_with_transformers_greedy_text(
    family, checkpoint_dir, tmp_path
):
    """`pdserve serve DIR` (a prefill node, a decode node, tcp): a completion of a prompt many
    blocks long is the text of transformers' greedy tokens."""
    import httpx
    from checkpoints import hf_greedy
    from conftest import random_prompts

    from pdserve.tune.local_server import PdserveServer, PdserveSystem

    model_dir = checkpoint_dir(family)
    prompts = random_prompts(9, [40, 100])
    expected = hf_greedy(model_dir, prompts, 10)
    tokenizer = LLM(str(model_dir), num_kv_blocks=16, device="cpu").tokenizer
    system = PdserveSystem(family, flags=("--insecure",))
    with PdserveServer(system, tmp_path, str(model_dir)) as server:
        for prompt, tokens_out in zip(prompts, expected, strict=True):
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(tokens_out)
