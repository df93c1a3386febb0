"""The cluster-wide prefix index: which KV blocks (by chained hash) each node holds in which tier,
as the nodes' own KV event streams say, and how long a prompt's cached prefix is on each node
(for a node of windowed or chunked layers, by the rule its own lookup applies to its KV groups).

Exact, not a guess: each node's stream (`cluster/kv_event_stream.py`) is applied in order, each
record once; a record that never came makes the index ask the node for a snapshot, and a node
that dies or registers again takes its entries with it. Its memory is what the nodes hold.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.cluster.block_hash import group_hash, prefix_hashes
from pdserve.cluster.kv_event_stream import TIERS, unpack_hashes
from pdserve.cluster.node_messages import KVEventRecord, KVEventsAck, KVOp
from pdserve.engine.kv.groups import KVGroups

logger = logging.getLogger(__name__)

RESYNC_AGAIN_AFTER = 8  # reports still showing a gap before a snapshot is asked for again
# Prompts whose block hashes are kept: one request's routing asks for the same prompt's hashes
# up to four times (local prefill, prefill node, early admission, admission).
HASHED_PROMPTS = 16


@dataclass(slots=True)
class PrefixMatch:
    """A prompt's leading blocks that one node holds, consecutive from the first, in any tier."""

    blocks: int = 0
    # Of those, how many in each tier (a block held in several counts in its fastest).
    by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))


@dataclass(slots=True)
class NodeBlocks:
    """One node's tiers, as its stream has told them so far."""

    stream: int
    next_seq: int = 1  # the next record to apply
    tiers: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in TIERS})
    resync_asked: bool = False  # a snapshot is asked for and has not begun yet
    gaps_since_asked: int = 0  # reports with a gap since then (the ask is asked again after a few)

    def apply(self, record: KVEventRecord) -> None:
        if record.op is KVOp.CLEAR:
            for held in self.tiers.values():
                held.clear()
            self.resync_asked = False
            self.gaps_since_asked = 0
            return
        held = self.tiers.get(record.tier)
        if held is None:
            logger.warning("KV event record of unknown tier %r ignored", record.tier)
            return
        hashes = unpack_hashes(record.hashes)
        if record.op is KVOp.STORED:
            held.update(hashes)
        else:
            held.difference_update(hashes)


class PrefixIndex:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeBlocks] = {}  # by node id
        self._hashed: OrderedDict[tuple[int, tuple[int, ...]], list[int]] = OrderedDict()

    def prompt_hashes(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """A prompt's chained block hashes (`cluster.block_hash.prefix_hashes`), of the last
        few prompts asked for computed once."""
        key = (block_size, tuple(token_ids))
        hashes = self._hashed.get(key)
        if hashes is None:
            hashes = self._hashed[key] = prefix_hashes(token_ids, block_size)
            if len(self._hashed) > HASHED_PROMPTS:
                self._hashed.popitem(last=False)
        else:
            self._hashed.move_to_end(key)
        return hashes

    def register(self, node_id: str, stream: int) -> None:
        """A node (re)registered with this event stream (0: it publishes none): what an earlier
        incarnation held is gone; its stream's opening snapshot says what this one holds."""
        self.nodes.pop(node_id, None)
        if stream:
            self.nodes[node_id] = NodeBlocks(stream)

    def forget(self, node_id: str) -> None:
        """The node is dead: its blocks are of no use to anyone."""
        self.nodes.pop(node_id, None)

    def apply(self, node_id: str, stream: int, records: list[KVEventRecord]) -> KVEventsAck | None:
        """Apply a load report's records, each once and in order; the acknowledgement to send
        the node, if any (it drops what is acknowledged from its log)."""
        view = self.nodes.get(node_id)
        if view is None or stream != view.stream or not records:
            return None
        resync = False
        for record in records:
            if record.seq < view.next_seq:
                continue  # applied already (a repeated report, or one resent before an ack)
            if record.seq > view.next_seq and record.op is not KVOp.CLEAR:
                # A record never came (only a CLEAR may follow a gap): ask for a snapshot.
                resync = self._ask_resync(node_id, view, "missing")
                break
            try:
                view.apply(record)
            except ValueError as e:
                resync = self._ask_resync(node_id, view, f"malformed ({e})")
                break
            view.next_seq = record.seq + 1
        # Acknowledged again if the node still sends what was applied (the ack is on its way).
        if records[0].seq >= view.next_seq and not resync:
            return None
        return KVEventsAck(stream, view.next_seq - 1, resync)

    @staticmethod
    def _ask_resync(node_id: str, view: NodeBlocks, why: str) -> bool:
        """Whether to ask the node for a snapshot now: once, and again after a few reports
        that still show the gap (the answer would have come by then)."""
        if view.resync_asked and view.gaps_since_asked < RESYNC_AGAIN_AFTER:
            view.gaps_since_asked += 1
            return False
        logger.warning(
            "node %s: KV event %d %s: asking for a snapshot", node_id, view.next_seq, why
        )
        view.resync_asked, view.gaps_since_asked = True, 0
        return True

    def held(self, node_id: str, tier: str) -> set[int]:
        """The hashes a node holds in a tier (empty for a node unknown or without events)."""
        view = self.nodes.get(node_id)
        return view.tiers[tier] if view is not None else set()

    def match(
        self, node_id: str, hashes: list[int], groups: KVGroups | None = None, block_size: int = 0
    ) -> PrefixMatch:
        """The longest run of `hashes` (a prompt's chained block hashes) from the first that the
        node holds, in any tier, and its blocks by tier. A node whose layers are not all full
        attention (`groups`, with the block size) takes the longest prefix for which every KV
        group holds, under its group's key, the blocks its next query reads (a full group every
        block, a windowed one its window's), as its own lookup does; a position counts in the
        slowest tier of those blocks (none read there: the device's)."""
        found = PrefixMatch()
        view = self.nodes.get(node_id)
        if view is None:
            return found
        tiers = [(name, view.tiers[name]) for name in TIERS if view.tiers[name]]
        if groups is not None and any(kind.reach is not None for kind in groups.kinds):
            return _match_groups(tiers, hashes, groups, block_size)
        for h in hashes:
            tier = next((name for name, held in tiers if h in held), None)
            if tier is None:
                break
            found.blocks += 1
            found.by_tier[tier] += 1
        return found

    def node_blocks(self, node_id: str) -> dict[str, int]:
        """How many blocks the index holds for a node in each tier."""
        view = self.nodes.get(node_id)
        return {tier: len(view.tiers[tier]) if view is not None else 0 for tier in TIERS}

    def blocks_by_tier(self) -> dict[str, int]:
        """Blocks the index holds in each tier, over every node (a block on two nodes counts
        twice): its size."""
        return {tier: sum(len(v.tiers[tier]) for v in self.nodes.values()) for tier in TIERS}


def _match_groups(
    tiers: list[tuple[str, set[int]]], hashes: list[int], groups: KVGroups, block_size: int
) -> PrefixMatch:
    """PrefixIndex.match for a node of several KV groups (or of windowed layers only)."""
    kinds = [group.kind for group in groups.groups]
    tier_at: dict[tuple[int, int], str | None] = {}

    def tier(g: int, i: int) -> str | None:
        if (g, i) not in tier_at:
            h = group_hash(hashes[i], g)
            tier_at[g, i] = next((name for name, held in tiers if h in held), None)
        return tier_at[g, i]

    def reads(n: int, windowed_only: bool = False) -> list[tuple[int, int]]:
        return [
            (g, i)
            for g, kind in enumerate(kinds)
            if not (windowed_only and kind.reach is None)
            for i in range(kind.first_read(n * block_size) // block_size, n)
        ]

    limit = len(hashes)
    for g, kind in enumerate(kinds):  # a full group reads every block: its run bounds the hit
        if kind.reach is None:
            limit = next((i for i in range(limit) if tier(g, i) is None), limit)
    length = next((n for n in range(limit, 0, -1) if all(tier(g, i) for g, i in reads(n, True))), 0)
    slowest = ["device"] * length
    for g, i in reads(length):
        slowest[i] = max(slowest[i], tier(g, i), key=TIERS.index)
    found = PrefixMatch(length)
    for name in slowest:
        found.by_tier[name] += 1
    return found
