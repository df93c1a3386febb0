"""What a node says to the KV endpoint of each of its tensor-parallel ranks, and what they answer,
on the codec of every pdserve wire protocol (`pdserve.cluster.codec`): typed, versioned structs.
Rank 0 orders every rank alike, itself included (`pdserve.kv_transfer.rank_endpoint`).

Orders: RankExpect, RankCancel (a receiver's), RankConnect, RankSend (a sender's), RankClose.
Reports: RankInfo (a receiver is up), RankResults, RankStats, RankFailed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.cluster.codec import Codec, Message
from pdserve.kv_transfer.base import KVSend, TransferResult

RANK_PROTOCOL_VERSION = 2  # 2: frames end with a digest

Range = tuple[int, int]  # [start, end)


class RankExpect(Message, tag="expect"):
    transfer_id: str
    dst_blocks: list[int]
    layers: Range | None
    timeout_s: float


class RankCancel(Message, tag="cancel"):
    transfer_id: str
    reason: str


class RankConnect(Message, tag="connect"):
    transport: str
    peer_id: str
    info: dict[str, Any]


class RankSend(Message, tag="send"):
    """Send heads `heads` of the rank's pages of src_blocks into heads `dst_heads` of dst_blocks
    of the peer (a rank of the decode node)."""

    transport: str
    transfer_id: str
    peer_id: str
    src_blocks: list[int]
    dst_blocks: list[int]
    layers: Range
    timeout_s: float
    heads: Range | None = None
    dst_heads: Range | None = None
    # (step, layer): sent once the rank's own forward has that layer of that step in its pool
    # (layer-wise streaming, ordered from rank 0's forward); None: at once.
    after: Range | None = None

    def kv_send(self) -> KVSend:
        """The send this order asks of the rank's sender."""
        return KVSend(
            self.transfer_id,
            self.peer_id,
            self.src_blocks,
            self.dst_blocks,
            self.layers,
            self.timeout_s,
            self.heads,
            self.dst_heads,
        )


class RankClose(Message, tag="close"):
    pass


class Result(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A `TransferResult` as it travels."""

    transfer_id: str
    ok: bool
    error: str | None = None
    layers: Range | None = None
    integrity: str = ""

    @classmethod
    def of(cls, r: TransferResult) -> Result:
        return cls(r.transfer_id, r.ok, r.error, r.layers, r.integrity)

    def result(self) -> TransferResult:
        return TransferResult(self.transfer_id, self.ok, self.error, self.layers, self.integrity)


class RankInfo(Message, tag="info"):
    """A receiver rank is up: what senders need to reach it (`KVReceiver.info()`)."""

    info: dict[str, Any]


class RankResults(Message, tag="results"):
    transport: str
    results: list[Result]


class RankStats(Message, tag="stats"):
    stats: dict[str, int]


class RankFailed(Message, tag="failed"):
    """The rank's endpoint stopped working: every transfer it held has failed."""

    error: str


RankOrder = RankExpect | RankCancel | RankConnect | RankSend | RankClose
RankReport = RankInfo | RankResults | RankStats | RankFailed

rank_orders = Codec(
    "rank order", RANK_PROTOCOL_VERSION, (RankExpect, RankCancel, RankConnect, RankSend, RankClose)
)
rank_reports = Codec(
    "rank report", RANK_PROTOCOL_VERSION, (RankInfo, RankResults, RankStats, RankFailed)
)
