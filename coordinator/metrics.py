"""Prometheus metrics of the serving API: the nodes' KV blocks, queues and prefix-cache lookups,
the prefix index's size, and the requests in each phase, read from the coordinator at scrape time; request latency and
KV handoff histograms fed by the coordinator's listeners; beside them the same numbers under
vLLM's names (`vllm:*`, labelled `model_name`), for dashboards and endpoint pickers that read
vLLM's. `deploy/grafana/pdserve.json` charts them."""

from __future__ import annotations

import logging
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.cluster.node_messages import KVTierReport, NodeRole
from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.request_state import Phase, RequestState

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read alike.
VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
VLLM_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class ClusterCollector:
    """Gauges computed from the coordinator's registry of nodes and its active requests."""

    def __init__(self, coordinator: Coordinator, model_name: str) -> None:
        self.coordinator = coordinator
        self.model_name = model_name

    def collect(self):  # noqa: ANN201
        c = self.coordinator
        free = GaugeMetricFamily(
            "pdserve_kv_blocks_free", "Free KV blocks of a node (last report)", labels=["node"]
        )
        total = GaugeMetricFamily(
            "pdserve_kv_blocks_total", "KV blocks in a node's pool", labels=["node"]
        )
        node_running = GaugeMetricFamily(
            "pdserve_node_requests_running", "Sequences in a node's running batch", labels=["node"]
        )
        node_waiting = GaugeMetricFamily(
            "pdserve_node_requests_waiting", "Sequences queued on a node", labels=["node"]
        )
        alive = GaugeMetricFamily(
            "pdserve_node_up", "1 while a node is alive", labels=["node", "role"]
        )
        hits = CounterMetricFamily(
            "pdserve_prefix_cache_hit_blocks",
            "Prompt blocks a node found in its prefix cache (since the node started)",
            labels=["node"],
        )
        misses = CounterMetricFamily(
            "pdserve_prefix_cache_miss_blocks",
            "Prompt blocks a node looked up in its prefix cache and computed (since it started)",
            labels=["node"],
        )
        received = CounterMetricFamily(
            "pdserve_kv_transfer_blocks",
            "KV blocks whose pages a decode node received from prefill nodes (since it started)",
            labels=["node"],
        )
        moved = CounterMetricFamily(
            "pdserve_kv_transfer_bytes",
            "Bytes of KV pages a node's handoffs moved (since it started): sent by a prefill "
            "node, received by a decode node",
            labels=["node", "direction"],
        )
        reused = CounterMetricFamily(
            "pdserve_kv_transfer_blocks_reused",
            "Blocks of prompts admitted to a decode node that it already held in its prefix "
            "cache, so they were not sent (since it started)",
            labels=["node"],
        )
        integrity = CounterMetricFamily(
            "pdserve_kv_integrity_failures",
            "KV sends to a decode node whose pages landed other than they left (their digest "
            "did not match): each failed its handoff, and the request was prefilled again",
            labels=["node"],
        )
        forced = CounterMetricFamily(
            "pdserve_forced_tokens",
            "Output tokens a node appended where a request's constraint allowed one token alone, "
            "without a step of their own (--forced-tokens; since it started)",
            labels=["node"],
        )
        drafts = CounterMetricFamily(
            "pdserve_spec_decode_num_draft_tokens",
            "Draft tokens a node's speculative decoding proposed and verified (since it started)",
            labels=["node"],
        )
        accepted = CounterMetricFamily(
            "pdserve_spec_decode_num_accepted_tokens",
            "Of a node's verified draft tokens, those accepted (since it started)",
            labels=["node"],
        )
        per_position = CounterMetricFamily(
            "pdserve_spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their position among a step's drafts (0: the first)",
            labels=["node", "position"],
        )
        catch_up = CounterMetricFamily(
            "pdserve_spec_decode_draft_catch_up_tokens",
            "Tokens a node's draft model computed to catch its KV up with its sequences (after a "
            "handoff, the prompt; since it started)",
            labels=["node"],
        )
        draft_cached = CounterMetricFamily(
            "pdserve_spec_decode_draft_cached_tokens",
            "Tokens a node's draft model found in its own prefix cache instead of computing them "
            "(since it started)",
            labels=["node"],
        )
        tiers = tier_families()
        computed = CounterMetricFamily(
            "pdserve_prefill_tokens_computed",
            "Prompt tokens whose KV a node's steps computed: those found in its prefix cache or "
            "the KV tiers below it, or received from a prefill node, are not (since it started)",
            labels=["node"],
        )
        for node in list(c.nodes.nodes.values()):
            alive.add_metric([node.node_id, node.role.value], 1.0 if node.alive else 0.0)
            if not node.alive:
                continue
            free.add_metric([node.node_id], node.free_blocks)
            total.add_metric([node.node_id], node.num_blocks)
            node_running.add_metric([node.node_id], node.running)
            node_waiting.add_metric([node.node_id], node.waiting)
            hits.add_metric([node.node_id], node.prefix_hits)
            misses.add_metric([node.node_id], node.prefix_misses)
            forced.add_metric([node.node_id], node.forced_tokens)
            computed.add_metric([node.node_id], node.prefill_tokens_computed)
            if node.spec_draft_tokens:
                drafts.add_metric([node.node_id], node.spec_draft_tokens)
                accepted.add_metric([node.node_id], node.spec_accepted_tokens)
                for position, count in enumerate(node.spec_accepted_per_position):
                    per_position.add_metric([node.node_id, str(position)], count)
            if node.spec_draft_catch_up_tokens:
                catch_up.add_metric([node.node_id], node.spec_draft_catch_up_tokens)
                draft_cached.add_metric([node.node_id], node.spec_draft_cached_tokens)
            if node.kv_tiers is not None:
                add_tiers(tiers, node.node_id, node.kv_tiers)
            if node.role is NodeRole.PREFILL:
                moved.add_metric([node.node_id, "sent"], node.kv_bytes_sent)
            if node.role is NodeRole.DECODE:
                moved.add_metric([node.node_id, "received"], node.kv_bytes_received)
                received.add_metric([node.node_id], node.kv_blocks_received)
                reused.add_metric([node.node_id], node.kv_blocks_reused)
                integrity.add_metric([node.node_id], node.kv_integrity_failures)
        index = GaugeMetricFamily(
            "pdserve_prefix_index_blocks",
            "KV blocks a node holds in a tier (device, host, disk), by the coordinator's prefix "
            "index of the nodes' KV events",
            labels=["node", "tier"],
        )
        prefix_index = c.core.prefix_index
        for node_id in list(prefix_index.nodes):
            for tier, count in prefix_index.node_blocks(node_id).items():
                index.add_metric([node_id, tier], count)
        states = list(c.requests.values())
        decoding = sum(1 for s in states if s.phase is Phase.DECODING)
        phases = GaugeMetricFamily(
            "pdserve_requests_phase",
            "Requests at the coordinator by phase: prefilling, local_prefill, waiting_admission, "
            "admitting, transferring (KV on its way), decoding",
            labels=["phase"],
        )
        for phase in Phase:
            if phase is not Phase.DONE:
                phases.add_metric([phase.value], sum(1 for s in states if s.phase is phase))
        yield free
        yield total
        yield node_running
        yield node_waiting
        yield alive
        yield hits
        yield misses
        yield received
        yield moved
        yield reused
        yield integrity
        yield forced
        yield drafts
        yield accepted
        yield per_position
        yield catch_up
        yield draft_cached
        yield index
        yield from tiers.values()
        yield computed
        yield phases
        yield GaugeMetricFamily(
            "pdserve_requests_running", "Requests generating tokens on a decode node", decoding
        )
        yield GaugeMetricFamily(
            "pdserve_requests_waiting",
            "Requests not yet decoding: queued, prefilling, waiting for admission, transferring KV",
            len(states) - decoding,
        )
        yield from self.vllm_gauges(decoding, len(states) - decoding)

    def vllm_gauges(self, running: int, waiting: int):  # noqa: ANN201
        """vLLM's engine gauges, the whole cluster read as one engine (as the endpoint picker
        scrapes the coordinator as one server): its requests, and its decode nodes' KV."""
        by_model = ["model_name"]
        queues = {
            "vllm:num_requests_running": ("Requests decoding (pdserve_requests_running)", running),
            "vllm:num_requests_waiting": (
                "Requests not yet decoding (pdserve_requests_waiting)",
                waiting,
            ),
        }
        for name, (doc, value) in queues.items():
            family = GaugeMetricFamily(name, doc, labels=by_model)
            family.add_metric([self.model_name], value)
            yield family
        # The decode nodes' pools hold the running requests and bound how many more fit.
        decoders = [n for n in self.coordinator.nodes.nodes.values() if n.alive and n.role.decodes]
        total = sum(n.num_blocks for n in decoders)
        used = sum(n.num_blocks - n.free_blocks for n in decoders)
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "Fraction of the decode nodes' KV blocks in use (0 to 1), by their last reports",
            labels=by_model,
        )
        usage.add_metric([self.model_name], used / total if total else 0.0)
        yield usage


def tier_families() -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
    """The families of the nodes' KV tiers below their pools (--kv-host-bytes, --kv-disk-path),
    by the report field each reads."""
    by_tier = ["node", "tier"]
    return {
        "hit_blocks": CounterMetricFamily(
            "pdserve_kv_tier_hit_blocks",
            "Prompt blocks past a node's pool found in a KV tier below it and loaded back",
            labels=by_tier,
        ),
        "miss_blocks": CounterMetricFamily(
            "pdserve_kv_tier_miss_blocks",
            "Prompt blocks past a node's pool looked up in a KV tier and not found there",
            labels=by_tier,
        ),
        "written_bytes": CounterMetricFamily(
            "pdserve_kv_tier_written_bytes",
            "Bytes of KV blocks a node copied down to a tier",
            labels=by_tier,
        ),
        "loaded_bytes": CounterMetricFamily(
            "pdserve_kv_tier_loaded_bytes",
            "Bytes of KV blocks a node loaded back from a tier into its pool",
            labels=by_tier,
        ),
        "blocks": GaugeMetricFamily(
            "pdserve_kv_tier_blocks", "KV blocks a node's tier holds now", labels=by_tier
        ),
        "loads": CounterMetricFamily(
            "pdserve_kv_tier_loads",
            "Loads from a node's tiers that ended (one per request whose prefix came back)",
            labels=["node"],
        ),
        "load_seconds": CounterMetricFamily(
            "pdserve_kv_tier_load_seconds",
            "Time those loads took, from submission to the step that saw them end (divide by "
            "pdserve_kv_tier_loads_total for the mean)",
            labels=["node"],
        ),
        "failures": CounterMetricFamily(
            "pdserve_kv_tier_failures",
            "Block copies to or from a node's tiers that failed (a disk write, a disk file gone "
            "or corrupt): the block was computed instead",
            labels=["node"],
        ),
    }


def add_tiers(families: dict, node_id: str, report: KVTierReport) -> None:
    for name, family in families.items():
        value = getattr(report, name)
        if isinstance(value, dict):
            for tier, count in value.items():
                family.add_metric([node_id, tier], count)
        else:
            family.add_metric([node_id], value)


class Metrics:
    """One registry per server; `observe` is the coordinator listener. model_name: the served
    model's name, the `model_name` label of the `vllm:*` metrics."""

    def __init__(self, coordinator: Coordinator, model_name: str = "pdserve") -> None:
        disable_created_metrics()  # no `_created` series: they only add noise to every scrape
        self.registry = CollectorRegistry()
        self.registry.register(ClusterCollector(coordinator, model_name))
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time from a request's arrival at the coordinator to its first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "pdserve_requests_finished",
            "Requests ended, by finish reason (stop, length, abort, error)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.handoff = Histogram(
            "pdserve_kv_handoff_seconds",
            "Time from a prefilled request's admission into a decode node to its first token "
            "there: the KV transfer and one decode step",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.vllm = VLLMRequestMetrics(self.registry, model_name)
        self._handed_off: dict[str, int] = {}  # request id -> the attempt whose handoff was timed

    def observe(self, name: str, state: RequestState) -> None:
        try:
            if name == "first_token" and state.first_token_at is not None:
                ttft = state.first_token_at - state.arrival
                self.ttft.observe(ttft)
                self.vllm.ttft.observe(ttft)
            elif name == "tokens":
                self._on_tokens(state)
            elif name == "finished":
                self._on_finished(state)
        except Exception:  # metrics must never break the coordinator's message loop
            logger.exception("[%s] metrics listener failed", state.request_id)

    def _on_tokens(self, state: RequestState) -> None:
        """The first token a decode node made after a handoff ends that handoff."""
        if (
            state.phase is Phase.DECODING
            and state.prefill_node is not None
            and self._handed_off.get(state.request_id) != state.attempt
        ):
            self._handed_off[state.request_id] = state.attempt
            # The coordinator's clock is time.monotonic(), read in this same process.
            self.handoff.observe(time.monotonic() - state.handoff_started)

    def _on_finished(self, state: RequestState) -> None:
        self._handed_off.pop(state.request_id, None)
        reason = state.finish_reason or "error"
        num_prompt, num_out = len(state.prompt_token_ids), len(state.output_token_ids)
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_out)
        self.vllm.on_finished(reason, num_prompt, num_out)
        if reason not in ("stop", "length") or state.finished_at is None:
            return
        e2e = state.finished_at - state.arrival
        self.e2e.observe(e2e)
        self.vllm.e2e.observe(e2e)
        if state.first_token_at is not None and num_out > 1:
            tpot = (state.finished_at - state.first_token_at) / (num_out - 1)
            self.tpot.observe(tpot)
            self.vllm.itl.observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VLLMRequestMetrics:
    """The request histograms and counters under vLLM's names, each bound to the served model;
    `Metrics` observes them where it observes its own, with the same values."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        by_model = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from a request's arrival to its first token (pdserve_time_to_first_token_seconds)",
            by_model,
            buckets=VLLM_TTFT_BUCKETS,
            registry=registry,
        ).labels(model_name)
        # vLLM observes every gap between a request's tokens; pdserve one mean gap per request.
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Mean time between a request's output tokens after the first, one per request "
            "(pdserve_time_per_output_token_seconds)",
            by_model,
            buckets=VLLM_ITL_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's arrival to its last token (pdserve_e2e_request_latency_seconds)",
            by_model,
            buckets=VLLM_E2E_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Prompt tokens of finished requests (pdserve_prompt_tokens_total)",
            by_model,
            registry=registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Tokens generated (pdserve_generation_tokens_total)",
            by_model,
            registry=registry,
        ).labels(model_name)
        self.model_name = model_name
        self.success = Counter(
            "vllm:request_success",
            "Requests ended, by finish reason (pdserve_requests_finished_total)",
            ["model_name", "finished_reason"],
            registry=registry,
        )

    def on_finished(self, reason: str, num_prompt: int, num_out: int) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_out)
