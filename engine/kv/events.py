"""Blocks entering and leaving a node's KV tiers, by chained hash (`pdserve.cluster.block_hash`),
in the order they happened, until the node drains them into its next load report.

The device tier's events come from the block manager (a block registered in, or removed from,
the prefix cache); the host and disk tiers' from `pdserve.engine.kv.tiers`. Consecutive events
of one kind and tier share a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("device", "host", "disk")


@dataclass(slots=True)
class KVEventBatch:
    stored: bool  # True: the blocks entered the tier; False: they left it
    tier: str  # one of TIERS
    hashes: list[int] = field(default_factory=list)


class KVEvents:
    def __init__(self) -> None:
        self._batches: list[KVEventBatch] = []

    def stored(self, tier: str, block_hash: int) -> None:
        self._add(True, tier, block_hash)

    def removed(self, tier: str, block_hash: int) -> None:
        self._add(False, tier, block_hash)

    def _add(self, stored: bool, tier: str, block_hash: int) -> None:
        last = self._batches[-1] if self._batches else None
        if last is None or last.stored is not stored or last.tier != tier:
            last = KVEventBatch(stored, tier)
            self._batches.append(last)
        last.hashes.append(block_hash)

    def __len__(self) -> int:
        return sum(len(b.hashes) for b in self._batches)

    def drain(self) -> list[KVEventBatch]:
        """Every event since the last drain, oldest first; the log is empty after."""
        batches, self._batches = self._batches, []
        return batches
