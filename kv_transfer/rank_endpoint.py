"""The KV endpoint of a tensor-parallel rank other than 0, and rank 0's line to it.

Every rank of a node moves the pages of its own KV heads: a decode rank has a receiver over its
pool, a prefill rank senders over its pool. Rank 0 decides (what to expect, what to send where);
each other rank's process runs a `RankEndpointServer` thread that carries out rank 0's orders on
its own endpoint and reports back what its endpoint reports (results, failure, stats). The line
is a socket pair made by rank 0 before the rank's process starts (`endpoint_pair`), with pickled
tuples on it: both ends are this node's own processes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pdserve.engine.kv_cache import KVLayout, KVPool
from pdserve.kv_transfer.base import KVReceiver, KVSender, TransferResult

logger = logging.getLogger(__name__)

POLL_S = 0.002  # how often the server looks at its endpoint when no order comes


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
) -> tuple[RankEndpointSpec, RankEndpointLink]:
    """The spec to hand a rank's process (with its fd) and rank 0's end of the line."""
    ours, theirs = socket.socketpair()
    os.set_inheritable(theirs.fileno(), True)
    spec = RankEndpointSpec(role, theirs.detach(), transport, address, dict(options or {}))
    return spec, RankEndpointLink(ours)


def rank_endpoints(
    role: str,
    size: int,
    transport: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    options: dict[str, Any] | None = None,
) -> tuple[list[RankEndpointSpec], RankLinks]:
    """Specs for ranks 1..size-1 of a node and rank 0's lines to them; a receiver of rank r
    listens on port + r (any free port when port is 0). options: of every rank's endpoint (a
    receiver's `keys` and `encrypt`, a sender's `keys`)."""
    pairs = [
        endpoint_pair(role, transport, f"tcp://{host}:{port + rank if port else 0}", options)
        for rank in range(1, size)
    ]
    return [spec for spec, _ in pairs], RankLinks([link for _, link in pairs])


class RankEndpointLink:
    """Rank 0's end: orders go out from any thread; what comes back is read by `drain` (the
    node's loop)."""

    def __init__(self, sock: socket.socket) -> None:
        self._conn = Connection(sock.detach())
        self._lock = threading.Lock()
        self.failed: str | None = None
        self.info: dict | None = None  # a receiver's, once it is up
        self.stats: dict[str, int] = {}

    def order(self, *command: Any) -> None:
        if self.failed is not None:
            return
        try:
            with self._lock:
                self._conn.send(command)
        except OSError as exc:
            self.failed = f"the rank's KV endpoint is gone: {exc}"

    def drain(self) -> list[tuple]:
        """The results the rank reported since the last call, as (transport, [results]); its
        info, stats and failure are kept."""
        out: list[tuple] = []
        try:
            while self.failed is None and self._conn.poll(0):
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "info":
                    self.info = msg[1]
                elif kind == "stats":
                    self.stats = msg[1]
                elif kind == "failed":
                    self.failed = msg[1]
                else:
                    out.append(msg[1:])
        except (EOFError, OSError) as exc:
            self.failed = f"the rank's KV endpoint is gone: {exc!r}"
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
            if not self._conn.poll(0.05):
                waited += 0.05
            self.drain()
        return self.info

    def close(self) -> None:
        self.order("close")
        self._conn.close()


class RankLinks:
    """Rank 0's lines to ranks 1..N-1, shared by the node's endpoints (a sender per transport):
    what comes back is sorted by transport for each to collect."""

    def __init__(self, links: list[RankEndpointLink]) -> None:
        self.links = links
        self._results: dict[str, list[tuple[int, TransferResult]]] = {}

    def __len__(self) -> int:
        return len(self.links)

    def order(self, rank: int, *command: Any) -> None:
        self.links[rank - 1].order(*command)

    def results(self, transport: str) -> list[tuple[int, TransferResult]]:
        """(rank, result) of every result the ranks reported for this transport."""
        for rank, link in enumerate(self.links, 1):
            for name, results in link.drain():
                self._results.setdefault(name, []).extend((rank, r) for r in results)
        return self._results.pop(transport, [])

    def failed(self) -> dict[int, str]:
        """Ranks whose endpoint (or line) failed, and why."""
        return {r: link.failed for r, link in enumerate(self.links, 1) if link.failed}

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for link in self.links:
            for key, value in link.stats.items():
                out[key] = out.get(key, 0) + value
        return out

    def close(self) -> None:
        for link in self.links:
            link.close()


class RankEndpointServer:
    """A rank's end: makes its endpoint over the rank's pool and carries out rank 0's orders."""

    def __init__(self, spec: RankEndpointSpec, device: str) -> None:
        self.spec = spec
        self.device = device
        self._conn = Connection(spec.fd)
        self.receiver: KVReceiver | None = None
        self.senders: dict[str, KVSender] = {}
        self.pool: KVPool | None = None
        self._stats: dict[str, int] = {}
        self._failed: set[str] = set()
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
        self.pool = pool
        if self.receiver is not None:
            self._send("info", self.receiver.info())
        self._thread.start()

    def _send(self, *msg: Any) -> None:
        self._conn.send(msg)

    def _endpoints(self) -> list[KVReceiver | KVSender]:
        return [self.receiver] if self.receiver is not None else list(self.senders.values())

    def _sender(self, transport: str) -> KVSender:
        if transport not in self.senders:
            from pdserve.kv_transfer import make_sender

            self.senders[transport] = make_sender(transport, self.pool, **self.spec.options)
        return self.senders[transport]

    def _carry_out(self, command: tuple) -> None:
        kind, *args = command
        if kind == "close":
            self._running = False
        elif kind == "expect":
            tid, dst, layers, timeout_s = args
            try:
                self.receiver.expect(tid, dst, layers, timeout_s)
            except Exception as exc:  # reported as this rank's part of the transfer failing
                self._send("results", self.receiver.name, [TransferResult(tid, False, str(exc))])
        elif kind == "cancel":
            try:
                self.receiver.cancel(*args)
            except Exception as exc:
                logger.warning("cancel of %s on this rank failed: %s", args[0], exc)
        elif kind == "connect":
            transport, peer_id, info = args
            try:
                self._sender(transport).connect(peer_id, info)
            except Exception as exc:  # its sends fail with this
                logger.warning("connecting to %s failed: %s", peer_id, exc)
        elif kind == "send":
            transport, tid, peer_id, src, dst, layers, timeout_s, heads, dst_heads = args
            try:
                self._sender(transport).send(
                    tid, peer_id, src, dst, layers, timeout_s, heads=heads, dst_heads=dst_heads
                )
            except Exception as exc:
                failed = TransferResult(tid, False, f"send failed: {exc}", layers)
                self._send("results", transport, [failed])

    def _report(self) -> None:
        stats: dict[str, int] = {}
        for endpoint in self._endpoints():
            results = endpoint.poll()
            if results:
                self._send("results", endpoint.name, results)
            for key, value in endpoint.stats().items():
                stats[key] = stats.get(key, 0) + value
            if endpoint.failed is not None and endpoint.failed not in self._failed:
                self._failed.add(endpoint.failed)
                if self.receiver is not None:
                    self._send("failed", endpoint.failed)
        if stats != self._stats:
            self._stats = stats
            self._send("stats", stats)
        # A failed sender has failed its sends; the next send to its transport gets a new one.
        for transport, sender in list(self.senders.items()):
            if sender.failed is not None:
                del self.senders[transport]
                sender.close()

    def _serve(self) -> None:
        try:
            while self._running:
                if self._conn.poll(POLL_S):
                    self._carry_out(self._conn.recv())
                self._report()
        except (EOFError, OSError):
            pass  # rank 0 is gone: this process ends with it
        except Exception:
            logger.exception("the rank's KV endpoint failed")
            try:
                self._send("failed", "the rank's KV endpoint failed")
            except OSError:
                pass

    def close(self) -> None:
        self._running = False
        if self._thread.is_alive():
            self._thread.join(2)
        for endpoint in self._endpoints():
            endpoint.close()
