"""A node's KV event stream: the blocks entering and leaving its KV tiers, as numbered records
carried in its load reports until the coordinator's prefix index acknowledges them, so that the
index holds exactly what the node holds though reports are lost, repeated or reordered.

Each stream (one per registration) opens with a CLEAR record and a snapshot of every tier, then
the events in the order they happened. A record stays in the log, and in every load report, until
the coordinator acknowledges it (`KVEventsAck`); the coordinator applies each once, in order. When
it asks (it missed a record), or when the log outgrows a snapshot (nobody acknowledges), the log
restarts as a CLEAR and a snapshot. Torch-free: the engine's event log is read through `drain()`.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

from pdserve.cluster.node_messages import KVEventRecord, KVEventsAck, KVOp

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")  # fastest first
HASH_BYTES = 16  # a chained block hash (`cluster/block_hash.py`), little-endian
MAX_REPORT_HASHES = 8192  # per load report (128 KiB of hashes); the rest go in the next ones
MAX_RECORD_HASHES = 1024  # per record, so that a report fills up to its cap
# The log restarts as a snapshot once it holds this many times more hashes than a snapshot would.
COMPACT_RATIO = 4


def pack_hashes(hashes: Iterable[int]) -> bytes:
    return b"".join(h.to_bytes(HASH_BYTES, "little") for h in hashes)


def unpack_hashes(data: bytes) -> list[int]:
    if len(data) % HASH_BYTES:
        raise ValueError(f"{len(data)} bytes of hashes are not a multiple of {HASH_BYTES}")
    return [
        int.from_bytes(data[i : i + HASH_BYTES], "little") for i in range(0, len(data), HASH_BYTES)
    ]


class EventSource(Protocol):
    """The engine's event log (`pdserve.engine.kv.events.KVEvents`): batches with `stored`,
    `tier` and `hashes`, oldest first, each drained once."""

    def drain(self) -> list[Any]: ...


class KVEventStream:
    def __init__(self, source: EventSource, max_report_hashes: int = MAX_REPORT_HASHES) -> None:
        self.source = source
        self.max_report_hashes = max_report_hashes
        self.held: dict[str, set[int]] = {tier: set() for tier in TIERS}  # what the tiers hold
        self.stream = 0  # 0: not started (the node has not registered)
        self.next_seq = 1
        self.log: deque[KVEventRecord] = deque()  # not yet acknowledged, oldest first
        self.log_hashes = 0
        self.snapshots = 0  # streams opened or restarted (a CLEAR and a snapshot each)

    def restart(self) -> int:
        """A new stream, opening with a snapshot of the tiers (the node registers with it)."""
        self._collect()
        self.stream = secrets.randbits(63) | 1
        self.next_seq = 1
        self._snapshot()
        return self.stream

    def report(self) -> tuple[int, list[KVEventRecord]]:
        """The stream and its oldest records not yet acknowledged, up to a report's cap."""
        self._collect()
        records: list[KVEventRecord] = []
        size = 0
        for record in self.log:
            n = len(record.hashes) // HASH_BYTES
            if records and size + n > self.max_report_hashes:
                break
            records.append(record)
            size += n
        return self.stream, records

    def acknowledged(self, ack: KVEventsAck) -> None:
        """The coordinator applied the records up to ack.seq (and may want a snapshot)."""
        if ack.stream != self.stream:
            return  # of a stream this node has left
        while self.log and self.log[0].seq <= ack.seq:
            self.log_hashes -= len(self.log.popleft().hashes) // HASH_BYTES
        if ack.resync:
            logger.info("the coordinator asks for a snapshot of this node's KV tiers")
            self._collect()
            self._snapshot()

    def _collect(self) -> None:
        for batch in self.source.drain():
            held = self.held.get(batch.tier)
            if held is None:
                logger.warning("KV events of unknown tier %r ignored", batch.tier)
                continue
            if batch.stored:
                held.update(batch.hashes)
            else:
                held.difference_update(batch.hashes)
            if self.stream:
                op = KVOp.STORED if batch.stored else KVOp.REMOVED
                self._append(op, batch.tier, batch.hashes)
        snapshot = sum(len(h) for h in self.held.values())
        if self.log_hashes > COMPACT_RATIO * max(snapshot, self.max_report_hashes):
            self._snapshot()  # cheaper to send what the tiers hold than what happened

    def _snapshot(self) -> None:
        self.snapshots += 1
        self.log.clear()
        self.log_hashes = 0
        self._append(KVOp.CLEAR, "", [])
        for tier in TIERS:
            self._append(KVOp.STORED, tier, list(self.held[tier]))

    def _append(self, op: KVOp, tier: str, hashes: list[int]) -> None:
        if op is KVOp.CLEAR:
            self.log.append(KVEventRecord(self.next_seq, op))
            self.next_seq += 1
            return
        size = min(MAX_RECORD_HASHES, self.max_report_hashes)
        for start in range(0, len(hashes), size):
            chunk = hashes[start : start + size]
            self.log.append(KVEventRecord(self.next_seq, op, tier, pack_hashes(chunk)))
            self.next_seq += 1
            self.log_hashes += len(chunk)
