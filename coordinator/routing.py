"""Which node gets a request: pure decisions over the registry's view, testable without sockets.

Prefill: least-loaded (fewest queued prompt tokens) or prefix affinity (the node that last
prefilled the longest shared prefix, unless it is much busier). Decode: most free KV blocks, or
with decode-side prefix reuse the same affinity rule over the prefixes each decode node holds
(received or generated there), its load being the KV tokens it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdserve.cluster.block_hash import prefix_hashes
from pdserve.coordinator.nodes import NodeState


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


def pool_blocks(nodes: list[NodeState]) -> int:
    """The KV blocks of the nodes' pools, all together."""
    return sum(n.num_blocks for n in nodes)


class PrefixAffinity:
    """Remembers which node last took each block-chain hash into its cache (bounded LRU): one
    instance for prefill nodes, one for decode nodes. It keeps no more hashes than its nodes'
    KV pools hold blocks (`pool_blocks`, read at each record: nodes come and go), and never more
    than `capacity`: older hashes are out of the nodes' caches already and would only cost the
    coordinator memory (about 240 bytes each)."""

    def __init__(
        self, capacity: int = 200_000, pool_blocks: Callable[[], int] | None = None
    ) -> None:
        self.capacity = capacity
        self.pool_blocks = pool_blocks  # the blocks of the nodes it routes to, all together
        self.owner: OrderedDict[int, str] = OrderedDict()

    @property
    def limit(self) -> int:
        if self.pool_blocks is None:
            return self.capacity
        return min(self.capacity, self.pool_blocks())

    def choose(
        self,
        token_ids: Sequence[int],
        nodes: list[NodeState],
        min_blocks: int,
        max_load_ratio: float,
        load: Callable[[NodeState], int] = prefill_load,
        fallback_choice: Callable[[list[NodeState]], NodeState | None] = least_loaded,
    ) -> NodeState | None:
        """The node holding the longest prefix of token_ids (at least min_blocks full blocks)
        unless its load exceeds the fallback choice's by more than max_load_ratio times that
        load plus the prefix's tokens; else the fallback choice."""
        if not nodes:
            return None
        fallback = fallback_choice(nodes)
        by_id = {n.node_id: n for n in nodes}
        hashes = prefix_hashes(token_ids, nodes[0].block_size)
        # Longest cached prefix first.
        for depth in range(len(hashes), min_blocks - 1, -1):
            if depth == 0:
                break
            node = by_id.get(self.owner.get(hashes[depth - 1], ""))
            if node is None:
                continue
            # Worth it while its extra queue is less than the prefix compute it saves.
            slack = load(fallback) * max_load_ratio + depth * node.block_size
            if load(node) <= slack:
                return node
            break
        return fallback

    def record(self, token_ids: Sequence[int], node: NodeState) -> None:
        for h in prefix_hashes(token_ids, node.block_size):
            self.owner[h] = node.node_id
            self.owner.move_to_end(h)
        limit = self.limit
        while len(self.owner) > limit:
            self.owner.popitem(last=False)

    def forget_node(self, node_id: str) -> None:
        for h in [h for h, owner in self.owner.items() if owner == node_id]:
            del self.owner[h]
