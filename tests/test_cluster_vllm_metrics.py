"""vLLM's metric names on /metrics of a real cluster (1 prefill + 1 decode node): after a few
requests each `vllm:*` series, labelled with the served model's name, holds what its `pdserve_*`
counterpart holds; the KV usage is the decode node's used blocks over its pool. The README's table
names every vLLM name served."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from local_cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families
from test_cluster import make_prompts
from test_tp_cluster import complete_all
from waiting import wait_until

from pdserve.cluster.node_messages import NodeRole
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.metrics import Metrics
from pdserve.coordinator.nodes import NodeState
from pdserve.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
MODEL = "tiny-served"
# A vLLM name, with its labels, and the pdserve sample it must equal.
SAME_AS = {
    "vllm:num_requests_running": "pdserve_requests_running",
    "vllm:num_requests_waiting": "pdserve_requests_waiting",
    "vllm:prompt_tokens_total": "pdserve_prompt_tokens_total",
    "vllm:generation_tokens_total": "pdserve_generation_tokens_total",
    'vllm:request_success_total{finished_reason="length"}': (
        'pdserve_requests_finished_total{finish_reason="length"}'
    ),
    "vllm:time_to_first_token_seconds_count": "pdserve_time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "pdserve_time_to_first_token_seconds_sum",
    "vllm:inter_token_latency_seconds_count": "pdserve_time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count": "pdserve_e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "pdserve_e2e_request_latency_seconds_sum",
}


def samples(metrics: Metrics) -> dict[str, float]:
    """/metrics by sample name and labels, the model's label left out: {'name{a="b"}': value}."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if family.name.startswith("vllm:"):
                assert s.labels.pop("model_name") == MODEL, s
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@pytest.mark.cluster
def test_vllm_names_hold_what_their_pdserve_counterparts_hold():
    prompts = make_prompts(5, seed=51, lo=5, hi=40)
    with Cluster(1, 1) as cluster:
        metrics = Metrics(cluster.coordinator, model_name=MODEL)
        cluster.coordinator.listeners.append(metrics.observe)
        asyncio.run(complete_all(cluster.client_addr, prompts, GREEDY))
        cluster.wait_until_idle()

        def settled() -> dict[str, float] | None:
            m = samples(metrics)
            return m if all(m.get(v) == m.get(p) for v, p in SAME_AS.items()) else None

        m = wait_until(settled, "every vllm:* sample equal to its pdserve_* one")
        assert m['vllm:request_success_total{finished_reason="length"}'] == len(prompts)
        assert m["vllm:generation_tokens_total"] == len(prompts) * GREEDY.max_tokens
        assert m["vllm:prompt_tokens_total"] == sum(len(p) for p in prompts)
        for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
            assert m[f"vllm:{name}_seconds_count"] == len(prompts)
            assert m[f'vllm:{name}_seconds_bucket{{le="+Inf"}}'] == len(prompts)
        free = m['pdserve_kv_blocks_free{node="decode-0"}']
        total = m['pdserve_kv_blocks_total{node="decode-0"}']
        assert 0.0 <= m["vllm:kv_cache_usage_perc"] == (total - free) / total <= 1.0


def bare_coordinator() -> Coordinator:
    """A coordinator never started: its registry of nodes is what the test puts there."""
    return Coordinator(
        CoordinatorConfig(), node_addr="tcp://127.0.0.1:0", client_addr="tcp://127.0.0.1:0"
    )


def node(node_id: str, role: NodeRole, free: int, total: int, alive: bool = True) -> NodeState:
    return NodeState(
        node_id, role, b"", total, 8, 256, "tcp", {}, {}, alive=alive, free_blocks=free
    )


def test_kv_cache_usage_is_the_live_decoding_nodes_used_blocks_over_their_pools():
    coordinator = bare_coordinator()
    for n in (
        node("prefill-0", NodeRole.PREFILL, free=0, total=100),  # busy, and not counted
        node("decode-0", NodeRole.DECODE, free=10, total=100),
        node("both-0", NodeRole.COLOCATED, free=50, total=100),
        node("decode-1", NodeRole.DECODE, free=0, total=100, alive=False),
    ):
        coordinator.nodes.nodes[n.node_id] = n
    m = samples(Metrics(coordinator, model_name=MODEL))
    assert m["vllm:kv_cache_usage_perc"] == (90 + 50) / 200


def test_the_readme_tables_every_vllm_name_served():
    coordinator = bare_coordinator()
    served = {
        f.name + ("_total" if f.type == "counter" else "")
        for f in text_string_to_metric_families(Metrics(coordinator).render().decode())
        if f.name.startswith("vllm:")
    }
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    tabled = set(re.findall(r"^\| `(vllm:[a-z0-9_]+)", readme, re.MULTILINE))
    assert tabled == served
