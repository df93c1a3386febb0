"""Which node gets a request: pure decisions over the registry's view, testable without sockets.

Prefill: least-loaded (fewest queued prompt tokens) or prefix affinity (the node whose cached
blocks of the prompt save the most compute, by the cluster's prefix index, unless it is much
busier). Decode: most free KV blocks, or with decode-side prefix reuse the same rule over the
blocks each decode node holds, its load being the KV tokens it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.coordinator.nodes import NodeState
from pdserve.coordinator.prefix_index import PrefixIndex, PrefixMatch


def least_loaded(nodes: list[NodeState]) -> NodeState | None:
    return min(nodes, key=lambda n: (n.prefill_load, n.running + n.waiting), default=None)


def most_free_blocks(nodes: list[NodeState]) -> NodeState | None:
    """KV-capacity-aware decode choice: the node with the most free blocks (as a fraction)."""
    return max(
        nodes, key=lambda n: (n.available_blocks / max(n.num_blocks, 1), -n.running), default=None
    )


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
        match = index.match(node.node_id, index.prompt_hashes(token_ids, node.block_size))
        if match.blocks < min_blocks:
            continue
        saved = costs.saved_tokens(match, node.block_size)
        # Worth it while its extra load is less than the prefix compute it saves.
        if saved <= 0 or load(node) > ceiling + saved:
            continue
        if best is None or (saved, -load(node)) > (best.saved_tokens, -load(best.node)):
            best = PrefixChoice(node, match, saved)
    return best or PrefixChoice(fallback, PrefixMatch(), 0.0)
