"""KV integrity on a real cluster (1 prefill + 1 decode node): the decode node's receiver corrupts
some of what lands (PDSERVE_KV_FAULTS: 15 %, its first landing for sure with seed 1), each
corrupted handoff fails its digest check, the request is prefilled again, and every stream
equals the offline engine's token for token; the failures reach /metrics; every block of both
nodes comes back."""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.metrics import Metrics
from pdserve.engine import LLM, SamplingParams
from pdserve.kv_transfer.faults import ENV

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_corrupted_handoffs_are_caught_prefilled_again_and_counted(transport, monkeypatch):
    prompts = make_prompts(12, seed=41, lo=5, hi=60)
    expected = expected_outputs(LLM(num_kv_blocks=1024, block_size=8), prompts, GREEDY)
    monkeypatch.setenv(ENV, "corrupt=0.15,seed=1")  # the nodes inherit it; decode nodes use it
    # Retries enough that no request runs out of them (each fails with p = 0.15).
    with Cluster(1, 1, transport=transport, config=CoordinatorConfig(max_retries=8)) as cluster:
        assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
        node = cluster.wait_for_report(
            "decode-0", lambda n: n.kv_integrity_failures > 0, "a digest failure"
        )
        text = Metrics(cluster.coordinator).render().decode()
        (line,) = [
            ln
            for ln in text.splitlines()
            if ln.startswith('pdserve_kv_integrity_failures_total{node="decode-0"}')
        ]
        assert float(line.split()[-1]) == node.kv_integrity_failures
        cluster.wait_until_idle()


def test_with_kv_integrity_off_prefill_nodes_send_no_digests(monkeypatch):
    # Every landing corrupted, and nothing checks: the handoffs succeed (what integrity is for).
    prompts = make_prompts(4, seed=43, lo=5, hi=40)
    monkeypatch.setenv(ENV, "corrupt=1.0,seed=1")
    with Cluster(1, 1, node_options={"kv_integrity": False}) as cluster:
        got = asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY))
        assert [len(tokens) for tokens in got] == [GREEDY.max_tokens] * len(prompts)
        # A load report taken after the decode node sent every token it served: it counts every
        # landing those requests made.
        cluster.wait_until_idle()
        assert cluster.node("decode-0").kv_integrity_failures == 0
