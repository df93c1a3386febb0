"""The KV endpoint of each tensor-parallel rank of a node, and the node's line to it.

Every rank of a node moves the pages of its own KV heads: a decode rank has a receiver over its
pool, a prefill rank senders over its pool. Rank 0 decides (what to expect, what to send where)
and orders every rank alike, itself included: each rank's `RankWorker` carries out the orders
(`pdserve.kv_transfer.rank_messages`) on its own endpoint and reports back what its endpoint
reports (results, failure, stats). Rank 0's worker is called in its process (`LocalRankLink`);
another rank's runs in a thread of that rank's process (`RankEndpointServer`), on a socket pair
made by rank 0 before the rank's process starts (`endpoint_pair`), the messages on the codec.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pdserve.cluster.codec import ProtocolError
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer.base import KVReceiver, KVSender, TransferResult
from pdserve.kv_transfer.rank_messages import (
    RankCancel,
    RankClose,
    RankConnect,
    RankExpect,
    RankFailed,
    RankInfo,
    RankOrder,
    RankReport,
    RankResults,
    RankSend,
    RankStats,
    Result,
    rank_orders,
    rank_reports,
)

logger = logging.getLogger(__name__)

POLL_S = 0.002  # how often a rank's server looks at its endpoint when no order comes


class RankWorker:
    """One rank's endpoint: a receiver over its pool (decode), or a sender per transport over it
    (prefill, made on first use). `carry_out` an order; `collect` what the endpoint reported
    since the last call; `layer_done` from the rank's forward releases the sends that wait for
    that layer (layer-wise streaming: rank 0 orders a layer's send as its own layer ends, and
    another rank may not have computed it yet). Orders and collection come from one thread,
    `layer_done` from the forward's."""

    def __init__(
        self,
        pool: KVPool,
        receiver: KVReceiver | None = None,
        sender_options: dict[str, Any] | None = None,
    ) -> None:
        self.pool = pool
        self.receiver = receiver
        self.sender_options = dict(sender_options or {})
        self.senders: dict[str, KVSender] = {}
        self._reports: list[RankReport] = [RankInfo(receiver.info())] if receiver else []
        self._stats: dict[str, int] = {}
        self._failed: set[str] = set()
        self.closed = False
        self._lock = threading.Lock()  # the forward's thread and the orders' one
        self._progress: tuple[int, int] = (-1, -1)  # (step, layer) the rank's forward is past
        self._waiting: list[RankSend] = []  # sends whose layer this rank has not computed yet

    def _endpoints(self) -> list[KVReceiver | KVSender]:
        return [self.receiver] if self.receiver is not None else list(self.senders.values())

    def _sender(self, transport: str) -> KVSender:
        from pdserve.kv_transfer import make_sender

        with self._lock:  # (made from the orders' thread or the forward's)
            if transport not in self.senders:
                self.senders[transport] = make_sender(transport, self.pool, **self.sender_options)
            return self.senders[transport]

    def _failed_result(self, transport: str, result: TransferResult) -> None:
        with self._lock:
            self._reports.append(RankResults(transport, [Result.of(result)]))

    def layer_done(self, step: int, layer: int) -> None:
        """The rank's forward has layer `layer` of step `step` in its pool: the sends waiting
        for it go now, from this thread (on a GPU the sender's event is recorded on the
        forward's stream, after that layer's kernels)."""
        with self._lock:
            self._progress = (step, layer)
            due = [s for s in self._waiting if tuple(s.after) <= self._progress]
            self._waiting = [s for s in self._waiting if tuple(s.after) > self._progress]
        for order in due:
            self._send(order)

    def _send(self, order: RankSend) -> None:
        try:
            self._sender(order.transport).send(order.kv_send())
        except Exception as exc:
            failed = TransferResult(order.transfer_id, False, f"send failed: {exc}", order.layers)
            self._failed_result(order.transport, failed)

    def carry_out(self, order: RankOrder) -> None:
        if isinstance(order, RankClose):
            self.close()
        elif isinstance(order, RankExpect):
            try:
                self.receiver.expect(
                    order.transfer_id, order.dst_blocks, order.layers, order.timeout_s
                )
            except Exception as exc:  # reported as this rank's part of the transfer failing
                failed = TransferResult(order.transfer_id, False, str(exc))
                self._failed_result(self.receiver.name, failed)
        elif isinstance(order, RankCancel):
            try:
                self.receiver.cancel(order.transfer_id, order.reason)
            except Exception as exc:
                logger.warning("cancel of %s on this rank failed: %s", order.transfer_id, exc)
        elif isinstance(order, RankConnect):
            # Raises what the receiver's info does not satisfy (rank 0's caller sees it; another
            # rank's server logs it, and the sends to that peer fail).
            self._sender(order.transport).connect(order.peer_id, order.info)
        elif isinstance(order, RankSend):
            with self._lock:
                wait = order.after is not None and tuple(order.after) > self._progress
                if wait:
                    self._waiting.append(order)
            if not wait:
                self._send(order)

    def collect(self) -> list[RankReport]:
        """Results, a failure and changed stats of the rank's endpoints since the last call."""
        stats: dict[str, int] = {}
        for endpoint in self._endpoints():
            results = endpoint.poll()
            if results:
                report = RankResults(endpoint.name, [Result.of(r) for r in results])
                with self._lock:
                    self._reports.append(report)
            for key, value in endpoint.stats().items():
                stats[key] = stats.get(key, 0) + value
            if endpoint.failed is not None and endpoint.failed not in self._failed:
                self._failed.add(endpoint.failed)
                if endpoint is self.receiver:
                    with self._lock:
                        self._reports.append(RankFailed(endpoint.failed))
        with self._lock:
            if stats != self._stats:
                self._stats = stats
                self._reports.append(RankStats(stats))
            # A failed sender has failed its sends; the next send to its transport gets a new
            # one.
            for transport, sender in list(self.senders.items()):
                if sender.failed is not None:
                    del self.senders[transport]
                    sender.close()
            reports, self._reports = self._reports, []
        return reports

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for endpoint in self._endpoints():
            endpoint.close()
        self.senders.clear()


class RankLink:
    """Rank 0's view of one rank's endpoint: orders go out from any thread; what comes back is
    read by `drain` (the node's loop), which keeps the rank's info, stats and failure."""

    def __init__(self) -> None:
        self.failed: str | None = None
        self.info: dict | None = None  # a receiver's, once it is up
        self.stats: dict[str, int] = {}

    def order(self, order: RankOrder) -> None:
        raise NotImplementedError

    def _reports(self) -> list[RankReport]:
        raise NotImplementedError

    def drain(self) -> list[tuple[str, list[TransferResult]]]:
        """(transport, results) the rank reported since the last call."""
        out = []
        for report in self._reports():
            if isinstance(report, RankInfo):
                self.info = report.info
            elif isinstance(report, RankStats):
                self.stats = report.stats
            elif isinstance(report, RankFailed):
                self.failed = report.error
            else:
                out.append((report.transport, [r.result() for r in report.results]))
        return out

    def wait_info(self, timeout_s: float, check: Any = None) -> dict:
        """A receiver rank's info, once its pool and receiver are up; check() raises if the rank
        died meanwhile."""
        waited = 0.0
        while self.info is None:
            if self.failed is not None:
                raise RuntimeError(self.failed)
            if waited > timeout_s:
                raise TimeoutError(f"a rank's KV receiver was not up after {timeout_s}s")
            if check is not None:
                check()
            if not self._wait(0.05):
                waited += 0.05
            self.drain()
        return self.info

    def _wait(self, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        self.order(RankClose())


class LocalRankLink(RankLink):
    """Rank 0's own endpoint: its worker, called in the node's process (a send from the handoff
    socket's thread as well as the loop: the endpoints take calls from any thread)."""

    def __init__(self, worker: RankWorker) -> None:
        super().__init__()
        self.worker = worker
        self._lock = threading.Lock()

    def order(self, order: RankOrder) -> None:
        with self._lock:
            self.worker.carry_out(order)

    def _reports(self) -> list[RankReport]:
        with self._lock:
            return self.worker.collect()

    def layer_done(self, step: int, layer: int) -> None:
        self.worker.layer_done(step, layer)


class RemoteRankLink(RankLink):
    """Another rank's endpoint, over the socket pair to its process's server."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._conn = Connection(sock.detach())
        self._lock = threading.Lock()

    def order(self, order: RankOrder) -> None:
        if self.failed is not None:
            return
        try:
            with self._lock:
                self._conn.send_bytes(rank_orders.encode(order))
        except OSError as exc:
            self.failed = f"the rank's KV endpoint is gone: {exc}"

    def _reports(self) -> list[RankReport]:
        out: list[RankReport] = []
        try:
            while self.failed is None and self._conn.poll(0):
                out.append(rank_reports.decode(self._conn.recv_bytes()))
        except (EOFError, OSError) as exc:
            self.failed = f"the rank's KV endpoint is gone: {exc!r}"
        except ProtocolError as exc:  # our own process sent it: a bug, not junk
            self.failed = f"the rank's KV endpoint sent a malformed report: {exc}"
        return out

    def _wait(self, timeout_s: float) -> bool:
        return self._conn.poll(timeout_s)

    def close(self) -> None:
        super().close()
        self._conn.close()


class RankLinks:
    """Rank 0's lines to every rank of the node, 0 included, shared by the node's endpoints (a
    sender per transport): what comes back is sorted by transport for each to collect."""

    def __init__(self, links: list[RankLink]) -> None:
        self.links = links
        self._results: dict[str, list[tuple[int, TransferResult]]] = {}
        self._closed = False

    def __len__(self) -> int:
        return len(self.links)

    def order(self, rank: int, order: RankOrder) -> None:
        self.links[rank].order(order)

    def results(self, transport: str) -> list[tuple[int, TransferResult]]:
        """(rank, result) of every result the ranks reported for this transport."""
        for rank, link in enumerate(self.links):
            for name, results in link.drain():
                self._results.setdefault(name, []).extend((rank, r) for r in results)
        return self._results.pop(transport, [])

    def layer_done(self, step: int, layer: int) -> None:
        """From rank 0's forward: its progress, for the sends its own worker holds."""
        for link in self.links:
            if isinstance(link, LocalRankLink):
                link.layer_done(step, layer)

    def failed(self) -> dict[int, str]:
        """Ranks whose endpoint (or line) failed, and why."""
        return {r: link.failed for r, link in enumerate(self.links) if link.failed}

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for link in self.links:
            for key, value in link.stats.items():
                out[key] = out.get(key, 0) + value
        return out

    def close(self) -> None:
        if self._closed:  # (every sender of a node shares them)
            return
        self._closed = True
        for link in self.links:
            link.close()


@dataclass
class RankEndpointSpec:
    """How a rank makes its endpoint (picklable: part of the rank's start-up spec)."""

    role: str  # "receiver" (decode) or "sender" (prefill)
    fd: int  # the rank's end of the line to rank 0, inherited by its process
    transport: str | None = None  # a receiver's
    address: str | None = None  # where a receiver listens
    options: dict[str, Any] = field(default_factory=dict)

    def serve(self, device: str) -> RankEndpointServer:
        """In the rank's process: its endpoint's server (what `RankKVEndpoint` asks of it)."""
        return RankEndpointServer(self, device)


def endpoint_pair(
    role: str,
    transport: str | None = None,
    address: str | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[RankEndpointSpec, RemoteRankLink]:
    """The spec to hand a rank's process (with its fd) and rank 0's end of the line."""
    ours, theirs = socket.socketpair()
    os.set_inheritable(theirs.fileno(), True)
    spec = RankEndpointSpec(role, theirs.detach(), transport, address, dict(options or {}))
    return spec, RemoteRankLink(ours)


def rank_endpoints(
    role: str,
    size: int,
    transport: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    options: dict[str, Any] | None = None,
) -> tuple[list[RankEndpointSpec], list[RemoteRankLink]]:
    """Specs for ranks 1..size-1 of a node and rank 0's lines to them; a receiver of rank r
    listens on port + r (any free port when port is 0). options: of every rank's endpoint (a
    receiver's `keys` and `encrypt`, a sender's `keys`)."""
    pairs = [
        endpoint_pair(role, transport, f"tcp://{host}:{port + rank if port else 0}", options)
        for rank in range(1, size)
    ]
    return [spec for spec, _ in pairs], [link for _, link in pairs]


class RankEndpointServer:
    """A rank's end, in its process: makes its endpoint over the rank's pool, then a thread
    carries out rank 0's orders on it and sends back what it reports."""

    def __init__(self, spec: RankEndpointSpec, device: str) -> None:
        self.spec = spec
        self.device = device
        self._conn = Connection(spec.fd)
        self.receiver: KVReceiver | None = None
        self.worker: RankWorker | None = None
        self._thread = threading.Thread(target=self._serve, name="kv-rank-endpoint", daemon=True)
        self._running = True

    @property
    def pool_factory(self):  # noqa: ANN201
        """How the rank's pool is made: by its receiver (decode), or the default (prefill)."""
        return self._make_receiver if self.spec.role == "receiver" else None

    def _make_receiver(self, layout: KVLayout, num_blocks: int) -> KVPool:
        from pdserve.kv_transfer import make_receiver

        self.receiver = make_receiver(
            self.spec.transport,
            layout,
            num_blocks,
            device=self.device,
            address=self.spec.address,
            **self.spec.options,
        )
        return self.receiver.pool

    def start(self, pool: KVPool) -> None:
        options = {} if self.receiver is not None else self.spec.options
        self.worker = RankWorker(pool, self.receiver, options)
        self._thread.start()

    def layer_done(self, step: int, layer: int) -> None:
        self.worker.layer_done(step, layer)

    def _serve(self) -> None:
        worker = self.worker
        try:
            while self._running and not worker.closed:
                if self._conn.poll(POLL_S):
                    order = rank_orders.decode(self._conn.recv_bytes())
                    try:
                        worker.carry_out(order)
                    except Exception as exc:  # e.g. a receiver this rank cannot reach
                        logger.warning("rank order %s failed: %s", order.TYPE, exc)
                for report in worker.collect():
                    self._conn.send_bytes(rank_reports.encode(report))
        except (EOFError, OSError):
            pass  # rank 0 is gone: this process ends with it
        except Exception:
            logger.exception("the rank's KV endpoint failed")
            try:
                failed = RankFailed("the rank's KV endpoint failed")
                self._conn.send_bytes(rank_reports.encode(failed))
            except OSError:
                pass

    def close(self) -> None:
        self._running = False
        if self._thread.is_alive():
            self._thread.join(2)
        if self.worker is not None:
            self.worker.close()
