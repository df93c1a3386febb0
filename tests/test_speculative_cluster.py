"""Speculative decoding on decode nodes, disaggregated for real: a prefill node hands each prompt
to a decode node that speculates (n-gram over tcp and shm; a draft model over tcp, its KV
prefilled on the decode node from the prompt), and every stream equals the offline engine's
without speculation, greedy and seeded; the decode node's draft and acceptance counts reach
/metrics; a decode node killed mid-speculation changes no token (the request resumes, and
speculates, on the other: with a draft model, its draft prefilled there again)."""

from __future__ import annotations

import asyncio

import pytest
from checkpoints import build_draft_checkpoint
from local_cluster import Cluster

from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.metrics import Metrics
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.embedded.catalog import resolve_model_dir

pytestmark = pytest.mark.cluster

MODEL = "pdserve-stories"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
STORIES = [
    "Once upon a time, there was a little cat named Tom. Tom liked to play in the garden. ",
    "One day, Lily saw a big red ball in the park. Lily liked the ball. One day, Lily ",
    "Tom the dog was happy. Tom the dog ran to the river. Tom the dog ",
]
PARAMS = [
    SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=48, temperature=0.7, seed=11, ignore_eos=True),
]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, num_kv_blocks=1024, block_size=8, device="cpu")


@pytest.fixture(scope="module")
def draft_config(tmp_path_factory) -> str:
    """draft_model with the target's first two layers: its greedy choice about half the time."""
    path = tmp_path_factory.mktemp("draft")
    draft = build_draft_checkpoint(resolve_model_dir(MODEL), path, num_layers=2)
    return f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 3}}'


def expected(offline: LLM) -> list[list[int]]:
    return [o.token_ids for p in PARAMS for o in offline.generate(STORIES, p)]


def drafted(node) -> bool:  # noqa: ANN001
    """An idle node's report that counts drafts."""
    return node.spec_draft_tokens > 0 and node.running == 0 and node.waiting == 0


async def run_all(addr: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    async with CoordinatorClient(addr) as client:
        jobs = [client.complete(ids, p) for p in PARAMS for ids in prompt_ids]
        return [tokens for tokens, _ in await asyncio.gather(*jobs)]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_speculating_decode_node_streams_the_tokens_of_plain_decoding(offline, transport):
    want = expected(offline)
    prompt_ids = [offline.tokenizer.encode(s) for s in STORIES]
    engines = {"decode-0": {"speculative_config": NGRAM}}
    with Cluster(1, 1, transport=transport, model=MODEL, node_engines=engines) as cluster:
        assert asyncio.run(run_all(cluster.client_addr, prompt_ids)) == want
        cluster.wait_until_idle()  # every block back
        node = cluster.wait_for_report("decode-0", drafted, "verified drafts")
        assert 0 < node.spec_accepted_tokens < node.spec_draft_tokens
        assert sum(node.spec_accepted_per_position) == node.spec_accepted_tokens
        prefill = cluster.coordinator.nodes.nodes["prefill-0"]
        assert prefill.spec_draft_tokens == 0  # prefill nodes sample one token: no drafts
        lines = Metrics(cluster.coordinator).render().decode().splitlines()
        for name, value in (
            ("pdserve_spec_decode_num_draft_tokens_total", node.spec_draft_tokens),
            ("pdserve_spec_decode_num_accepted_tokens_total", node.spec_accepted_tokens),
        ):
            assert f'{name}{{node="decode-0"}} {value}.0' in lines
        first = node.spec_accepted_per_position[0]
        line = 'pdserve_spec_decode_num_accepted_tokens_per_pos_total{node="decode-0",position="0"}'
        assert f"{line} {first}.0" in lines


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_decode_node_killed_mid_speculation_changes_no_token(offline, draft_config, method):
    # With a draft model, the other decode node prefills the draft from the resumed prompt.
    want = expected(offline)
    prompt_ids = [offline.tokenizer.encode(s) for s in STORIES]
    config = NGRAM if method == "ngram" else draft_config
    engines = {d: {"speculative_config": config} for d in ("decode-0", "decode-1")}
    with Cluster(1, 2, model=MODEL, node_engines=engines) as cluster:

        async def run_with_kill() -> list[list[int]]:
            async with CoordinatorClient(cluster.client_addr) as client:
                jobs = [client.complete(ids, p) for p in PARAMS for ids in prompt_ids]
                tasks = [asyncio.create_task(job) for job in jobs]
                await cluster.kill_mid_output("decode-0")
                return [tokens for tokens, _ in await asyncio.gather(*tasks)]

        assert asyncio.run(run_with_kill()) == want
        cluster.wait_until_idle()
        node = cluster.wait_for_report("decode-1", drafted, "verified drafts")
        assert node.spec_accepted_tokens > 0


def test_a_decode_node_drafting_with_a_model_streams_the_tokens_of_plain_decoding(
    offline, draft_config
):
    want = expected(offline)
    prompt_ids = [offline.tokenizer.encode(s) for s in STORIES]
    engines = {node: {"speculative_config": draft_config} for node in ("prefill-0", "decode-0")}
    with Cluster(1, 1, transport="tcp", model=MODEL, node_engines=engines) as cluster:
        assert asyncio.run(run_all(cluster.client_addr, prompt_ids)) == want
        cluster.wait_until_idle()  # every block back
        node = cluster.wait_for_report("decode-0", drafted, "verified drafts")
        assert 0 < node.spec_accepted_tokens < node.spec_draft_tokens
