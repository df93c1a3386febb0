"""DeepSeek checkpoints served disaggregated, for real: the latent KV pages (one "head" per
token and layer, the same on every tensor-parallel rank) hand off from a TP=2 prefill node to a
TP=1 decode node and from a TP=1 prefill node to a TP=2 decode node, over tcp and shm, and
every stream equals the offline engine's (which equals transformers', test_mla_models.py);
every block comes back. (`pdserve serve DIR` of these checkpoints: test_moe_cluster.py.)"""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# (family, transport, prefill TP, decode TP)
CASES = [
    ("deepseek_v3", "tcp", 2, 1),
    ("deepseek_v3", "shm", 1, 2),
    ("deepseek_v2", "shm", 2, 1),
    ("deepseek_v2", "tcp", 1, 2),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{t}-P{p}-D{d}" for f, t, p, d in CASES])
def served(request, checkpoint_dir):
    family, transport, prefill_tp, decode_tp = request.param
    model = str(checkpoint_dir(family))
    engines = {}
    if prefill_tp > 1:
        engines["prefill-0"] = {"tensor_parallel_size": prefill_tp}
    if decode_tp > 1:
        engines["decode-0"] = {"tensor_parallel_size": decode_tp}
    with Cluster(
        1, 1, transport=transport, model=model, node_engines=engines, num_kv_blocks=160
    ) as cluster:
        yield cluster, LLM(model, num_kv_blocks=1024, block_size=8, device="cpu")


def test_latent_pages_hand_off_between_tensor_parallel_sizes(served):
    cluster, offline = served
    prompts = make_prompts(8, seed=37, lo=5, hi=60)
    expected = expected_outputs(offline, prompts, GREEDY)
    assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
    cluster.wait_until_idle()  # every block of both nodes free
