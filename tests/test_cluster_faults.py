"""Injected faults on a real cluster (1 prefill + 1 decode node, tcp): every message any socket
of the node links, the handoff socket and the KV transfers receives may be lost, delayed,
repeated, reordered, cut or changed (PDSERVE_FAULTS, a few percent of each, in the coordinator
and the nodes alike). The streams still equal the offline engine's token for token, and every KV
block comes back. The faults happen (counted), and the link sessions resend what was lost."""

from __future__ import annotations

import asyncio

import pytest
from local_cluster import Cluster
from test_cluster import expected_outputs, make_prompts
from test_tp_cluster import complete_all

from pdserve.cluster.faults import ENV
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
FAULTS = "drop=0.04,delay=0.04,duplicate=0.04,reorder=0.04,truncate=0.02,corrupt=0.02,seed=11"


def test_message_faults_at_every_seam_change_no_token_and_strand_no_block(monkeypatch):
    prompts = make_prompts(16, seed=53, lo=5, hi=60)
    expected = expected_outputs(LLM(num_kv_blocks=1024, block_size=8), prompts, GREEDY)
    monkeypatch.setenv(ENV, FAULTS)  # read by the coordinator here and by the nodes it starts
    # A KV handoff whose control messages are lost times out and is prefilled again.
    config = CoordinatorConfig(heartbeat_timeout_s=3.0, transfer_timeout_s=3.0, max_retries=8)
    with Cluster(1, 1, config=config) as cluster:
        assert asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY)) == expected
        faults = cluster.coordinator._node_faults
        assert faults is not None and sum(faults.injected.values()) > 0
        sessions = cluster.coordinator._sessions.values()
        assert sum(s.resent for s in sessions) > 0  # what the nodes lost was sent again
        assert sum(s.duplicates for s in sessions) > 0  # and what came twice was dropped
        cluster.wait_until_idle()
