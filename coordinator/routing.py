"""Which node gets a request: pure decisions over the registry's view, testable without sockets.

Prefill: least-loaded (fewest queued prompt tokens) or prefix affinity (the node whose cached
blocks of the prompt save the most compute, by the cluster's prefix index, unless it is much
busier). Decode: most free KV blocks, or with decode-side prefix reuse the same rule over the
blocks each decode node holds, its load being the KV tokens it holds. Under the coordinator's
settings: where a prompt is prefilled (conditional disaggregation), which decode node takes it
early (layer-wise KV streaming) and which one at admission; the core carries the choices out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.cluster.node_messages import NodeRole
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.nodes import NodeState
from pdserve.coordinator.prefix_index import PrefixIndex, PrefixMatch


def least_loaded(nodes: list[NodeState]) -> NodeState | None:
    return min(nodes, key=lambda n: (n.prefill_load, n.running + n.waiting), default=None)


def most_free_blocks(nodes: list[NodeState]) -> NodeState | None:
    """KV-capacity-aware decode choice: the node with the most free blocks (as a fraction)."""
    return max(
        nodes, key=lambda n: (n.available_blocks / max(n.num_blocks, 1), -n.running), default=None
    )


def has_room(node: NodeState, num_blocks: int, watermark: float) -> bool:
    """Room above the watermark; an idle node takes anything that fits at all, so a sequence
    bigger than the headroom cannot block the queue forever."""
    if node.running == 0 and node.reserved_blocks == 0:
        return node.available_blocks >= num_blocks
    reserve = int(node.num_blocks * watermark)
    return node.available_blocks - num_blocks >= reserve


def prefill_load(node: NodeState) -> int:
    """Prompt tokens queued or routed to a prefill node."""
    return node.prefill_load


def kv_load(node: NodeState) -> int:
    """KV tokens a decode node holds or has been promised: its used blocks."""
    return (node.num_blocks - node.available_blocks) * node.block_size


@dataclass(frozen=True, slots=True)
class TierCosts:
    """What loading one block from a tier below the device costs, as a fraction of computing it
    again (0: free, 1: no better than recomputing)."""

    host: float = 0.1
    disk: float = 0.5

    def saved_tokens(self, match: PrefixMatch, block_size: int) -> float:
        """The prompt tokens a node holding `match` need not compute, each block below the
        device counted less its loading cost."""
        by_tier = match.by_tier
        blocks = (
            by_tier["device"]
            + by_tier["host"] * (1 - self.host)
            + by_tier["disk"] * (1 - self.disk)
        )
        return blocks * block_size


@dataclass(slots=True)
class PrefixChoice:
    node: NodeState
    match: PrefixMatch  # the prompt's leading blocks it holds (none: the fallback choice)
    saved_tokens: float  # of the prompt's tokens, those it need not compute (tier-weighted)


def choose_by_prefix(
    index: PrefixIndex,
    token_ids: Sequence[int],
    nodes: list[NodeState],
    min_blocks: int,
    max_load_ratio: float,
    costs: TierCosts,
    load: Callable[[NodeState], int] = prefill_load,
    fallback_choice: Callable[[list[NodeState]], NodeState | None] = least_loaded,
) -> PrefixChoice | None:
    """The node that saves the most of the prompt's compute by the blocks it holds (at least
    min_blocks of its prefix, in any tier, weighted by tier), among those whose load exceeds
    the fallback choice's by no more than max_load_ratio times that load plus the tokens it
    saves; else the fallback choice. None when there are no nodes."""
    fallback = fallback_choice(nodes)
    if fallback is None:
        return None
    best: PrefixChoice | None = None
    ceiling = load(fallback) * max_load_ratio
    for node in nodes:
        hashes = index.prompt_hashes(token_ids, node.block_size)
        match = index.match(node.node_id, hashes, node.kv_groups, node.block_size)
        if match.blocks < min_blocks:
            continue
        saved = costs.saved_tokens(match, node.block_size)
        # Worth it while its extra load is less than the prefix compute it saves.
        if saved <= 0 or load(node) > ceiling + saved:
            continue
        if best is None or (saved, -load(node)) > (best.saved_tokens, -load(best.node)):
            best = PrefixChoice(node, match, saved)
    return best or PrefixChoice(fallback, PrefixMatch(), 0.0)


# --- placement under the coordinator's settings ---------------------------------------------------


def choose_by_affinity(
    config: CoordinatorConfig,
    index: PrefixIndex,
    token_ids: Sequence[int],
    nodes: list[NodeState],
    load: Callable[[NodeState], int],
    fallback_choice: Callable[[list[NodeState]], NodeState | None],
) -> PrefixChoice | None:
    """The node whose KV tiers save the most of this prompt's compute, load allowing
    (`choose_by_prefix` with the coordinator's prefix affinity settings)."""
    return choose_by_prefix(
        index,
        token_ids,
        nodes,
        config.prefix_affinity_min_blocks,
        config.prefix_affinity_max_load_ratio,
        TierCosts(config.prefix_host_load_cost, config.prefix_disk_load_cost),
        load=load,
        fallback_choice=fallback_choice,
    )


def choose_prefill_node(
    config: CoordinatorConfig,
    index: PrefixIndex,
    token_ids: Sequence[int],
    prefillers: list[NodeState],
) -> NodeState | None:
    """The prefill node for a prompt, by prefill_routing: prefix affinity or least loaded."""
    if config.prefill_routing == "prefix_affinity":
        choice = choose_by_affinity(
            config, index, token_ids, prefillers, prefill_load, least_loaded
        )
        return choice.node if choice is not None else None
    return least_loaded(prefillers)


def choose_local_prefill_node(
    config: CoordinatorConfig,
    index: PrefixIndex,
    token_ids: Sequence[int],
    decoders: list[NodeState],
    prefillers: list[NodeState],
) -> NodeState | None:
    """Conditional disaggregation: the decode node to prefill this prompt itself, or None to
    send it to a prefill node. Local: when there is no prefill node; when the tokens the
    chosen decode node would have to compute (those its KV tiers do not hold) are at most
    local_prefill_max_uncached_tokens; for prompts shorter than conditional_disagg_threshold;
    when every prefill queue is over its limit."""
    candidates = [n for n in decoders if n.role is NodeRole.COLOCATED] or decoders
    if config.prefill_routing == "prefix_affinity" or config.decode_prefix_reuse:
        choice = choose_by_affinity(config, index, token_ids, candidates, kv_load, most_free_blocks)
    else:
        node = most_free_blocks(candidates)
        choice = PrefixChoice(node, PrefixMatch(), 0.0) if node is not None else None
    if choice is None or not prefillers:
        return choice.node if choice is not None else None
    uncached = len(token_ids) - choice.saved_tokens
    limit = config.prefill_queue_limit_tokens
    if (
        (0 < uncached <= config.local_prefill_max_uncached_tokens and choice.match.blocks)
        or len(token_ids) < config.conditional_disagg_threshold
        or (limit > 0 and all(n.prefill_load > limit for n in prefillers))
    ):
        return choice.node
    return None


def early_blocks(node: NodeState, num_tokens: int) -> int:
    """The blocks a prompt admitted early takes on a decode node: its KV and the first token's
    slot."""
    return node.blocks_for(num_tokens + 1)


def choose_early_decode_node(
    config: CoordinatorConfig,
    index: PrefixIndex,
    token_ids: Sequence[int],
    receivers: list[NodeState],
    num_waiting: int,
) -> NodeState | None:
    """Layer-wise KV streaming: the decode node to admit a long prompt into as its prefill
    starts. None (the request goes today's way) when streaming is off, the prompt is short,
    sequences wait for admission already (num_waiting: none is overtaken), or no decode node
    has room now."""
    if (
        not config.kv_streaming
        or len(token_ids) < config.kv_streaming_min_prompt_tokens
        or num_waiting > 0
    ):
        return None
    watermark = config.admission_watermark
    fitting = [n for n in receivers if has_room(n, early_blocks(n, len(token_ids)), watermark)]
    if config.decode_prefix_reuse:  # the decode node holding the longest prefix, load allowing
        choice = choose_by_affinity(config, index, token_ids, fitting, kv_load, most_free_blocks)
        return choice.node if choice is not None else None
    return most_free_blocks(fitting)


def choose_decode_by_prefix(
    config: CoordinatorConfig,
    index: PrefixIndex,
    computed_token_ids: Sequence[int],
    fitting: list[NodeState],
) -> NodeState | None:
    """With decode prefix reuse: the fitting decode node holding the longest prefix of the
    sequence's computed tokens, unless it is much fuller (the prefill side's rule)."""
    choice = choose_by_affinity(
        config, index, computed_token_ids, fitting, kv_load, most_free_blocks
    )
    return choice.node if choice is not None else None
