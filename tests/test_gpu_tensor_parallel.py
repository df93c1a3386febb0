"""Tensor parallelism on GPUs: NCCL collectives, the Triton kernels on every rank, decode steps
replayed from CUDA graphs captured on every rank with the all-reduces inside; and KV handoffs
between GPU groups over cuda_ipc and nccl. Each test needs its GPUs and skips cleanly without."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from conftest import random_prompts
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.engine import LLM, SamplingParams

pytestmark = [pytest.mark.cluster, pytest.mark.gpu]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def gpus(count: int, cupy: bool = False):  # noqa: ANN201
    have = torch.cuda.is_available() and torch.cuda.device_count() >= count
    if cupy:
        have = have and importlib.util.find_spec("cupy") is not None
    return pytest.mark.skipif(not have, reason=f"needs {count} CUDA devices" + (" and CuPy" * cupy))


@gpus(2)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_two_gpus_generate_what_one_does_from_graphs_captured_on_every_rank(checkpoint_dir, family):
    model = str(checkpoint_dir(family))
    prompts = random_prompts(7, [5, 30, 61])
    options = dict(device="cuda", dtype="float32", num_kv_blocks=256, kernel_backend="triton")
    expected = [o.token_ids for o in LLM(model, **options).generate(prompts, GREEDY)]
    with LLM(model, **options, tensor_parallel_size=2) as llm:
        assert llm.engine.runner.decode_graphs is not None
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.runner.decode_graphs.replays > 0
    assert tokens == expected


@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("cuda_ipc", marks=gpus(4, cupy=True)),
        pytest.param("nccl", marks=gpus(4, cupy=True)),
    ],
)
def test_gpu_groups_of_different_sizes_hand_off_kv(transport):
    # prefill-0: TP=2 on GPUs 0-1; decode-0: TP=1 on GPU 2; decode-1: TP=2 on GPUs 2-3 (shared
    # with decode-0: the nodes' communicators never pair a GPU with itself).
    engines = {
        "prefill-0": {"tensor_parallel_size": 2, "device": "cuda:0"},
        "decode-0": {"device": "cuda:2"},
        "decode-1": {"tensor_parallel_size": 2, "device": "cuda:2"},
    }
    offline = LLM(num_kv_blocks=1024, block_size=8)
    prompts = make_prompts(8, seed=31, lo=10, hi=50)
    expected = expected_outputs(offline, prompts, GREEDY)
    with Cluster(1, 2, transport=transport, node_engines=engines, dtype="float32") as cluster:
        assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
        cluster.wait_until_idle()
