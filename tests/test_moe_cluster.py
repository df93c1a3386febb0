"""Mixture-of-experts checkpoints served disaggregated, for real: a prefill node of two
tensor-parallel ranks hands its KV pages to a single-process decode node over tcp and over shm,
and every stream equals the offline engine's (which equals transformers', test_moe_models.py);
every block comes back. `pdserve serve DIR` of each mixture-of-experts family, DeepSeek's among
them, answers with transformers' greedy text."""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# (family, transport): each family once, Qwen3-MoE (sparse and dense layers) on both transports.
CASES = [("qwen3_moe", "tcp"), ("qwen3_moe", "shm"), ("mixtral", "tcp"), ("qwen2_moe", "shm")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{t}" for f, t in CASES])
def served(request, checkpoint_dir):
    family, transport = request.param
    model = str(checkpoint_dir(family))
    with Cluster(
        1,
        1,
        transport=transport,
        model=model,
        node_engines={"prefill-0": {"tensor_parallel_size": 2}},
        num_kv_blocks=160,
    ) as cluster:
        yield cluster, LLM(model, num_kv_blocks=1024, block_size=8, device="cpu")


def test_a_tp2_prefill_node_and_a_tp1_decode_node_stream_the_offline_tokens(served):
    cluster, offline = served
    prompts = make_prompts(8, seed=31, lo=5, hi=60)
    expected = expected_outputs(offline, prompts, GREEDY)
    assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
    cluster.wait_until_idle()  # every block of both nodes free


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
)
def test_pdserve_serve_answers_over_http_with_transformers_greedy_text(
    family, checkpoint_dir, tmp_path
):
    """`pdserve serve DIR` (a TP=2 prefill node, a decode node, tcp): a completion of token ids
    is the text of transformers' greedy tokens."""
    import httpx
    from checkpoints import hf_greedy
    from conftest import random_prompts

    from pdserve.tune.local_server import PdserveServer, PdserveSystem

    model_dir = checkpoint_dir(family)
    prompts = random_prompts(7, [9, 33])
    expected = hf_greedy(model_dir, prompts, 10)
    tokenizer = LLM(str(model_dir), num_kv_blocks=16, device="cpu").tokenizer
    flags = ("--insecure", "--prefill-tensor-parallel-size", "2")
    with PdserveServer(PdserveSystem(family, flags=flags), tmp_path, str(model_dir)) as server:
        for prompt, tokens in zip(prompts, expected, strict=True):
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(tokens)
