"""A node's KV endpoint over all its tensor-parallel ranks, behind the one-endpoint interface
(`KVReceiver`, `KVSender`): node code (`DecodeHandoff`, `PrefillHandoff`) never knows the node
is a group. Every rank's endpoint, rank 0's included, takes the same orders through its line
(`pdserve.kv_transfer.rank_endpoint`).

Decode side: the receiver's info carries every rank's (its address, its pool, its KV heads);
`expect` is expected by every rank, and a transfer completes once every rank has all its heads
of every layer; the first rank to fail ends the others' part. Prefill side: `connect` routes the
decode node's heads to our ranks (`head_routes`), and `send` has each route's rank send its head
slice to its destination rank; a send ends once every piece ended.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer.base import KVReceiver, KVSend, KVSender, TransferResult, TransportFailed
from pdserve.kv_transfer.head_routes import HeadRange, HeadRoute, route_heads
from pdserve.kv_transfer.rank_endpoint import LocalRankLink, RankLink, RankLinks, RankWorker
from pdserve.kv_transfer.rank_messages import RankCancel, RankConnect, RankExpect, RankSend

logger = logging.getLogger(__name__)

RANK_START_TIMEOUT_S = 300.0


@dataclass(slots=True)
class Pieces:
    """The ranks' parts of one transfer (receiver) or one send (sender) not ended yet."""

    waiting: set[int] | int  # ranks (receiver) or a count of pieces (sender)
    error: str | None = None
    ranks: set[int] = field(default_factory=set)  # sender: the ranks sending pieces
    integrity: set[str] = field(default_factory=set)  # receiver: each rank's digest check


def merged(integrity: set[str]) -> str:
    """A transfer's digest check over its ranks' (`TransferResult.integrity`): failed if any
    rank's failed, ok if every rank's was, off if any rank's sender sent none."""
    for verdict in ("failed", "off"):
        if verdict in integrity:
            return verdict
    return "ok" if integrity == {"ok"} else ""


class ShardedReceiver(KVReceiver):
    def __init__(
        self,
        local: KVReceiver,
        remote: list[RankLink],
        head_ranges: list[HeadRange],
        node_layout: KVLayout,
        check_ranks=None,  # noqa: ANN001
    ) -> None:
        """local: rank 0's receiver; remote: the lines to ranks 1..N-1 (rank 0's is made here,
        over local); head_ranges[r]: rank r's KV heads; check_ranks() raises if a rank died
        (waiting for the other ranks' receivers to be up)."""
        self.links = RankLinks([LocalRankLink(RankWorker(local.pool, local)), *remote])
        self.name = local.name
        self.pool = local.pool
        infos = [link.wait_info(RANK_START_TIMEOUT_S, check_ranks) for link in self.links.links]
        self._ranks = [
            {**info, "kv_heads": list(heads)}
            for info, heads in zip(infos, head_ranges, strict=True)
        ]
        self._node_layout = node_layout.to_dict()
        self._pending: dict[str, Pieces] = {}
        self._all = set(range(len(head_ranges)))

    @property
    def failed(self) -> str | None:
        failed = self.links.failed()
        if 0 in failed:
            return failed[0]
        return next((f"rank {r}: {why}" for r, why in sorted(failed.items())), None)

    def info(self) -> dict:
        # Rank 0's own, so a sender that knows nothing of ranks fails cleanly on its head count.
        return {**self._ranks[0], "tp_ranks": self._ranks, "node_layout": self._node_layout}

    def expect(
        self,
        transfer_id: str,
        dst_blocks: list[int],
        layers: tuple[int, int] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if self.failed is not None:
            raise TransportFailed(self.failed)
        order = RankExpect(transfer_id, list(dst_blocks), layers, timeout_s)
        self._pending[transfer_id] = Pieces(set(self._all))
        for rank in sorted(self._all):
            self.links.order(rank, order)

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        if self.failed is not None:
            raise TransportFailed(self.failed)
        self._cancel(transfer_id, reason, self._all)

    def _cancel(self, transfer_id: str, reason: str, ranks: set[int]) -> None:
        for rank in ranks:
            self.links.order(rank, RankCancel(transfer_id, reason))

    def poll(self) -> list[TransferResult]:
        results = self.links.results(self.name)
        lost = self.links.failed()
        out: list[TransferResult] = []
        for rank, result in results:
            error = None if result.ok else result.error
            self._ended(rank, result.transfer_id, error, out, result.integrity)
        for rank, why in lost.items():  # a rank whose endpoint died ends its part of everything
            for tid in [t for t, p in self._pending.items() if rank in p.waiting]:
                self._ended(rank, tid, f"rank {rank}: {why}", out)
        return out

    def _ended(
        self,
        rank: int,
        tid: str,
        error: str | None,
        out: list[TransferResult],
        integrity: str = "",
    ) -> None:
        pieces = self._pending.get(tid)
        if pieces is None or rank not in pieces.waiting:
            return
        pieces.waiting.discard(rank)
        pieces.integrity.add(integrity)
        if error is not None and pieces.error is None:
            pieces.error = error if rank == 0 else f"rank {rank}: {error}"
            self._cancel(tid, f"another rank's part failed: {error}", set(pieces.waiting))
        if not pieces.waiting:
            del self._pending[tid]
            out.append(
                TransferResult(
                    tid, pieces.error is None, pieces.error, integrity=merged(pieces.integrity)
                )
            )

    def stats(self) -> dict[str, int]:
        return self.links.stats()

    def close(self) -> None:
        self.links.close()


class ShardedSender(KVSender):
    def __init__(
        self,
        transport: str,
        pool: KVPool,
        links: RankLinks,
        head_ranges: list[HeadRange],
        node_layout: KVLayout,
        progress: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        """The node's sender of one transport over its ranks' senders; links: to every rank,
        0 included (`rank_links`); head_ranges[r]: rank r's KV heads; progress(): the (step,
        layer) of rank 0's forward when a send is made from its layer hook (layer-wise
        streaming: every rank sends that layer once its own forward has it), else None."""
        self.links = links
        self.progress = progress
        self.name = transport
        self.pool = pool
        self.head_ranges = head_ranges
        self.node_layout = node_layout
        self._known: dict[str, dict] = {}
        self._routes: dict[str, list[HeadRoute]] = {}
        self._pending: dict[tuple[str, tuple[int, int]], Pieces] = {}
        self._ended: list[TransferResult] = []  # sends over, for the next poll
        self._lock = threading.Lock()  # sends come from the handoff thread, polls from the loop

    @property
    def failed(self) -> str | None:
        return self.links.failed().get(0)

    def connect(self, peer_id: str, receiver_info: dict) -> None:
        if self._known.get(peer_id) == receiver_info:
            return
        ranks = receiver_info.get("tp_ranks")
        if ranks is None:  # a receiver of one rank: all the model's heads
            heads = receiver_info["layout"]["num_kv_heads"]
            ranks = [{**receiver_info, "kv_heads": [0, heads]}]
        total = max(r["kv_heads"][1] for r in ranks)
        if total != self.node_layout.num_kv_heads:
            raise ValueError(
                f"KV layout mismatch in field 'num_kv_heads': {self.node_layout.num_kv_heads!r} "
                f"!= {total!r}"
            )
        dst_heads = [tuple(r["kv_heads"]) for r in ranks]
        if self.node_layout.layer_shapes and dst_heads != [tuple(h) for h in self.head_ranges]:
            # A lane of a slot's page is no range of the pool's heads: pages move whole.
            raise ValueError(
                "a model whose layers' KV pages differ in shape (Gemma 4) hands off between "
                "nodes of equal tensor-parallel sizes only: this node's ranks hold KV heads "
                f"{[list(h) for h in self.head_ranges]}, the receiver's {[list(h) for h in dst_heads]}"
            )
        routes = route_heads(self.head_ranges, dst_heads)
        for src, dst in dict.fromkeys((r.src_rank, r.dst_rank) for r in routes):
            # Rank 0's connect raises here what the receiver's info does not satisfy.
            self.links.order(src, RankConnect(self.name, _rank_peer(peer_id, dst), ranks[dst]))
        with self._lock:
            self._routes[peer_id] = routes
            self._known[peer_id] = receiver_info

    def send(self, send: KVSend) -> None:
        if send.heads is not None or send.dst_heads is not None:
            raise ValueError("a sharded sender routes heads itself")
        with self._lock:
            routes = self._routes.get(send.peer_id)
        if routes is None:
            raise ValueError(f"not connected to peer {send.peer_id!r}")
        rng = (0, self.node_layout.num_slots) if send.layers is None else tuple(send.layers)
        key = (send.transfer_id, (int(rng[0]), int(rng[1])))
        with self._lock:
            self._pending[key] = Pieces(len(routes), ranks={r.src_rank for r in routes})
        src, dst = list(send.src_blocks), list(send.dst_blocks)
        after = self.progress() if self.progress is not None else None
        for route in routes:
            order = RankSend(
                self.name,
                send.transfer_id,
                _rank_peer(send.peer_id, route.dst_rank),
                src,
                dst,
                key[1],
                send.timeout_s,
                route.src_heads,
                route.dst_heads,
                after,
            )
            self.links.order(route.src_rank, order)  # a piece that cannot start reports so

    def poll(self) -> list[TransferResult]:
        results = self.links.results(self.name)
        with self._lock:
            for rank, result in results:
                key = (result.transfer_id, tuple(result.layers or (0, self.node_layout.num_slots)))
                error = None
                if not result.ok:
                    error = result.error if rank == 0 else f"rank {rank}: {result.error}"
                self._piece_ended(key, error)
            for rank, why in self.links.failed().items():
                # A rank whose line died reports no more: its pieces of every send fail.
                for key, pieces in list(self._pending.items()):
                    if rank in pieces.ranks:
                        pieces.error = pieces.error or f"rank {rank}: {why}"
                        self._end(key)
            out, self._ended = self._ended, []
        return out

    def _piece_ended(self, key: tuple[str, tuple[int, int]], error: str | None) -> None:
        """(Lock held.)"""
        pieces = self._pending.get(key)
        if pieces is None:
            return
        pieces.waiting -= 1
        if error is not None and pieces.error is None:
            pieces.error = error
        if pieces.waiting <= 0:
            self._end(key)

    def _end(self, key: tuple[str, tuple[int, int]]) -> None:
        """(Lock held.) The send is over: its result goes out at the next poll."""
        pieces = self._pending.pop(key, None)
        if pieces is not None:
            self._ended.append(TransferResult(key[0], pieces.error is None, pieces.error, key[1]))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"outstanding": len(self._pending), "peers": len(self._known)}

    def close(self) -> None:
        self.links.close()


def rank_links(
    pool: KVPool, remote: list[RankLink], sender_options: dict | None = None
) -> RankLinks:
    """A prefill node's lines to its ranks: rank 0's worker over its pool (senders made with
    sender_options, e.g. the cluster keys), then the lines to ranks 1..N-1."""
    return RankLinks([LocalRankLink(RankWorker(pool, None, sender_options)), *remote])


def _rank_peer(peer_id: str, rank: int) -> str:
    """How a rank's sender names a decode node's rank."""
    return f"{peer_id}#{rank}"
