"""Windowed models served disaggregated, for real: a prefill node hands a Qwen2 checkpoint's KV
(one full layer, two layers with a 12-token window: three KV groups), or gpt-oss's (alternating
8-token windows and full layers, attention sinks, its experts: two groups), to a decode node over
tcp and shm, and with a prefill node of two tensor-parallel ranks; every stream equals the
offline engine's (which equals transformers', test_windowed_family_parity.py), the decode node
receives only the blocks its windowed layers will read, a chat's second turn reuses the first
turn's blocks of every group there, layer-wise streaming sends a slot once every group's layer
in it is done, every block comes back, and `pdserve serve DIR` of each windowed or chunked family
(Gemma 3, Gemma 4 and Llama 4 among them) answers with transformers' greedy text."""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster, complete
from local_cluster import random_tokens as tokens
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.coordinator.metrics import Metrics
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONGER = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BLOCK_SIZE = 8
# (window, windowed groups) of each family's tiny checkpoint (tests/checkpoints.py)
WINDOWS = {"qwen2_sliding": (12, 2), "gpt_oss": (8, 1)}
WINDOW, WINDOWED_GROUPS = WINDOWS["qwen2_sliding"]


def blocks_moved(prompt_len: int, family: str = "qwen2_sliding") -> tuple[int, int]:
    """(blocks a handoff of this prompt moves, blocks it would move were every layer full):
    the full group's every block; each windowed group's from the one holding the first token
    the decode node's first query reads (position prompt_len - window + 1)."""
    window, windowed_groups = WINDOWS[family]
    whole = -(-prompt_len // BLOCK_SIZE)
    last = whole - max(0, prompt_len - window + 1) // BLOCK_SIZE
    return whole + windowed_groups * last, (1 + windowed_groups) * whole


CASES = [
    ("qwen2_sliding", "tcp", 1),
    ("qwen2_sliding", "shm", 1),
    ("qwen2_sliding", "tcp", 2),
    ("gpt_oss", "shm", 1),
    ("gpt_oss", "tcp", 2),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{t}-prefill-tp{n}" for f, t, n in CASES])
def served(request, checkpoint_dir):
    family, transport, prefill_tp = request.param
    model = str(checkpoint_dir(family))
    with Cluster(
        1,
        1,
        transport=transport,
        model=model,
        node_engines={"prefill-0": {"tensor_parallel_size": prefill_tp}},
        num_kv_blocks=160,
        block_size=BLOCK_SIZE,
    ) as cluster:
        yield cluster, LLM(model, num_kv_blocks=1024, block_size=BLOCK_SIZE, device="cpu"), family


def test_streams_equal_offline_and_only_the_windows_blocks_move(served):
    cluster, offline, family = served
    prompts = make_prompts(8, seed=37, lo=20, hi=90)  # up to 7 windows long
    expected = expected_outputs(offline, prompts, GREEDY)
    assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
    cluster.wait_until_idle()  # every block of both nodes free
    moved = sum(blocks_moved(len(p), family)[0] for p in prompts)
    every_layer_full = sum(blocks_moved(len(p), family)[1] for p in prompts)
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


def test_a_second_turn_reuses_every_groups_blocks_on_the_decode_node(checkpoint_dir):
    model = str(checkpoint_dir("qwen2_sliding"))
    offline = LLM(model, num_kv_blocks=1024, block_size=BLOCK_SIZE, device="cpu")
    turn1 = tokens(29, seed=1)
    (answer1,) = [o.token_ids for o in offline.generate([turn1], LONGER)]
    turn2 = turn1 + answer1 + tokens(13, seed=2)  # 58 tokens: 7 full blocks and a partial one
    (answer2,) = [o.token_ids for o in offline.generate([turn2], LONGER)]
    with Cluster(1, 1, model=model, num_kv_blocks=160, block_size=BLOCK_SIZE) as cluster:
        assert complete(cluster, turn1, LONGER) == answer1
        first = blocks_moved(len(turn1))[0]
        cluster.wait_for_report("decode-0", lambda n: n.kv_blocks_received == first, "turn 1")
        assert complete(cluster, turn2, LONGER) == answer2
        # Turn 1's 44 tokens of KV left 5 full blocks in every group, and each windowed
        # group's last window (tokens 29..40 before the hit's end) among them: 5 reused; the
        # full group receives blocks 5..7, each windowed group the same 3 (its window from 47).
        node = cluster.wait_for_report(
            "decode-0", lambda n: n.kv_blocks_reused == 5, "turn 2's reused blocks"
        )
        assert node.kv_blocks_received == first + 3 + WINDOWED_GROUPS * 3
        cluster.wait_until_idle()


@pytest.mark.parametrize(
    "family",
    ["qwen2_sliding", "mistral_sliding", "gpt_oss", "gemma3_text", "gemma4_text", "llama4_text"],
)
def test_pdserve_serve_answers_over_http_with_transformers_greedy_text(
    family, checkpoint_dir, tmp_path
):
    """`pdserve serve DIR` (a prefill node, a decode node, tcp): a completion of a prompt
    several windows long is the text of transformers' greedy tokens."""
    import httpx
    from checkpoints import hf_greedy
    from conftest import random_prompts

    from pdserve.tune.local_server import PdserveServer, PdserveSystem

    model_dir = checkpoint_dir(family)
    prompts = random_prompts(9, [40, 75])
    expected = hf_greedy(model_dir, prompts, 10)
    tokenizer = LLM(str(model_dir), num_kv_blocks=16, device="cpu").tokenizer
    system = PdserveSystem(family, flags=("--insecure",))
    with PdserveServer(system, tmp_path, str(model_dir)) as server:
        for prompt, tokens_out in zip(prompts, expected, strict=True):
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(tokens_out)


def test_layer_wise_streaming_sends_each_slot_once_every_groups_layer_in_it_is_done(
    checkpoint_dir,
):
    """gpt-oss's groups interleave (full layers 1 and 3, windowed 0 and 2: slot 0 holds layers
    1 and 0, slot 1 layers 3 and 2): streamed handoffs, of prompts prefilled in chunks, give the
    offline tokens and move exactly the window's blocks."""
    from pdserve.coordinator.config import CoordinatorConfig

    model = str(checkpoint_dir("gpt_oss"))
    offline = LLM(model, num_kv_blocks=1024, block_size=BLOCK_SIZE, device="cpu")
    streaming = CoordinatorConfig(
        heartbeat_timeout_s=3.0,
        transfer_timeout_s=10.0,
        kv_streaming=True,
        kv_streaming_min_prompt_tokens=24,
    )
    prompts = make_prompts(6, seed=43, lo=30, hi=90)
    expected = expected_outputs(offline, prompts, GREEDY)
    with Cluster(
        1,
        1,
        model=model,
        config=streaming,
        num_kv_blocks=160,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=32,  # prompts over 32 tokens prefill in chunks
    ) as cluster:
        assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
        cluster.wait_until_idle()
        moved = sum(blocks_moved(len(p), "gpt_oss")[0] for p in prompts)
        node = cluster.wait_for_report(
            "decode-0", lambda n: n.kv_blocks_received >= moved, f"{moved} blocks received"
        )
        assert node.kv_blocks_received == moved
