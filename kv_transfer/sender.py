"""The sender every transport shares: one background thread owns a DEALER (plus a monitor) per
receiver, runs the handshake, moves the pages of each send() and collects acks.

connect() only checks the receiver's info and returns; the thread says Hello, and sends made
before the Welcome wait for it (failing if the receiver refuses or does not answer in time).

Push transports (tcp, nccl) cut a send into chunks (`pages.plan_chunks`) and stream them; direct
transports (shm, cuda_ipc) send Begin, wait for Go, write into the receiver's mapped pool and
send Done. Every send ends in exactly one TransferResult: ok on the receiver's Ack; failed on
Nack, timeout, or when the receiver's connection drops (then its socket and buffers are freed).
Here: the interface, the thread and the results; the peers' lifecycle is `sender_peers.py`, the
sends' pipeline `send_pipeline.py`, a send's state `outgoing.py`.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket as pysocket
import time
import uuid
from collections import deque

import torch
import zmq

from pdserve.cluster.codec import MalformedLog
from pdserve.cluster.faults import FAULTS_POLL_MS, message_faults
from pdserve.cluster.keys import ClusterKeys
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer import pages
from pdserve.kv_transfer.base import KVSend, KVSender, TransferResult
from pdserve.kv_transfer.channel import CommandThread, check_security
from pdserve.kv_transfer.integrity import algorithm_for as integrity_algorithm
from pdserve.kv_transfer.outgoing import Outgoing
from pdserve.kv_transfer.protocol import KV_PROTOCOL_VERSION, Pages
from pdserve.kv_transfer.send_pipeline import SendPipeline
from pdserve.kv_transfer.sender_peers import Peer, SenderPeers

log = logging.getLogger(__name__)


class ZmqSender(SenderPeers, SendPipeline, CommandThread, KVSender):
    """Sender base: subclasses say how chunks travel (push) or how pages are written (direct)."""

    name = "base"
    _role = "sender"
    direct = False

    def __init__(
        self,
        pool: KVPool,
        connect_timeout_s: float = 10.0,
        chunk_bytes: int = 8 << 20,
        max_inflight_chunks: int = 4,
        keys: ClusterKeys | None = None,
        integrity: bool = True,
    ) -> None:
        """keys: the cluster key set keyed receivers admit (None: only insecure ones);
        integrity: every chunk (or direct write) carries a digest of its pages, which the
        receiver checks once they have landed (`kv_transfer.integrity`)."""
        self.pool = pool
        self.integrity = integrity_algorithm(pool.kv) if integrity else None
        self.keys = keys
        self.layout: KVLayout = pool.layout
        self.connect_timeout_s = connect_timeout_s
        self.chunk_bytes = chunk_bytes
        self.max_inflight_chunks = max_inflight_chunks
        self.identity = f"{self.name}-{pysocket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ctx = zmq.Context(io_threads=1)
        self._stream = torch.cuda.Stream(pool.kv.device) if pool.kv.is_cuda else None
        self._send_ids = itertools.count(1)
        self._connections = itertools.count(1)
        self._known: dict[str, dict] = {}  # peer_id -> receiver info, as seen by callers
        self._peers: dict[str, Peer] = {}  # owned by the thread from here on
        self._outgoing: dict[int, Outgoing] = {}
        self._queue: deque[Outgoing] = deque()  # push sends not started yet
        self._malformed = MalformedLog(log, f"{self.name} KV sender")
        self._message_faults = message_faults(f"{self.name} KV sender")  # (PDSERVE_FAULTS)
        self._start_thread({"outstanding": 0, "peers": 0})

    # -- interface ---------------------------------------------------------------------------
    def connect(self, peer_id: str, receiver_info: dict) -> None:
        self._check_open()
        if self._known.get(peer_id) == receiver_info:
            return  # connected, or the handshake is under way: sends wait for it
        if receiver_info.get("transport") != self.name:
            raise ValueError(
                f"transport mismatch: sender is {self.name!r}, "
                f"receiver {receiver_info.get('transport')!r}"
            )
        if receiver_info.get("protocol") != KV_PROTOCOL_VERSION:
            raise ValueError(
                f"protocol mismatch: {receiver_info.get('protocol')} != {KV_PROTOCOL_VERSION}"
            )
        # Head counts may differ (tensor-parallel ranks): each send names the heads it moves.
        self.layout.check_compatible(
            KVLayout.from_dict(receiver_info["layout"]), ignore=("num_kv_heads",)
        )
        check_security(self.keys, receiver_info)
        self._check_receiver(receiver_info)
        info = dict(receiver_info)
        self._command("connect", peer_id, info)
        self._known[peer_id] = info

    def send(self, send: KVSend) -> None:
        self._check_open()
        info = self._known.get(send.peer_id)
        if info is None:
            raise ValueError(f"not connected to peer {send.peer_id!r}")
        src, dst = [int(b) for b in send.src_blocks], [int(b) for b in send.dst_blocks]
        if len(src) != len(dst) or not src:
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
        if len(set(dst)) != len(dst):
            raise ValueError("destination blocks repeat")
        if any(not 0 <= b < self.pool.num_blocks for b in src):
            raise ValueError(f"source blocks outside [0, {self.pool.num_blocks})")
        if any(not 0 <= b < info["num_blocks"] for b in dst):
            raise ValueError(f"destination blocks outside [0, {info['num_blocks']})")
        layers = send.layers
        l0, l1 = (0, self.layout.num_slots) if layers is None else (int(layers[0]), int(layers[1]))
        if not 0 <= l0 < l1 <= self.layout.num_slots:
            raise ValueError(f"layer range {(l0, l1)} outside [0, {self.layout.num_slots}]")
        heads, dst_heads = self._head_slices(
            send.heads, send.dst_heads, info["layout"]["num_kv_heads"]
        )
        ready = None
        if self.pool.kv.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.pool.kv.device))
        out = Outgoing(
            next(self._send_ids),
            send.transfer_id,
            send.peer_id,
            src,
            dst,
            (l0, l1),
            send.timeout_s,
            time.monotonic() + send.timeout_s,
            ready,
            heads=heads,
            dst_heads=dst_heads,
        )
        self._command("send", out, info)

    def _head_slices(
        self, heads: tuple[int, int] | None, dst_heads: tuple[int, int] | None, dst_total: int
    ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """Check a send's head slices (None: all of that pool's); returned None where whole."""
        mine = self.layout.num_kv_heads
        h0, h1 = (0, mine) if heads is None else (int(heads[0]), int(heads[1]))
        d0, d1 = (0, dst_total) if dst_heads is None else (int(dst_heads[0]), int(dst_heads[1]))
        if not 0 <= h0 < h1 <= mine:
            raise ValueError(f"heads {(h0, h1)} outside this pool's [0, {mine})")
        if not 0 <= d0 < d1 <= dst_total:
            raise ValueError(
                f"destination heads {(d0, d1)} outside the receiver's [0, {dst_total})"
            )
        if h1 - h0 != d1 - d0:
            raise ValueError(
                f"{h1 - h0} KV heads sent into {d1 - d0} (a pool of {mine} heads into one of "
                f"{dst_total}: name the heads)"
            )
        return (
            None if (h0, h1) == (0, mine) else (h0, h1),
            None if (d0, d1) == (0, dst_total) else (d0, d1),
        )

    def close(self) -> None:
        if self._closed:
            return
        if self._stop_thread():
            self._ctx.destroy(linger=0)  # (the sockets a dead thread could not close, too)

    # -- transport hooks ---------------------------------------------------------------------
    def _check_receiver(self, info: dict) -> None:
        """In connect(): raise ValueError if this receiver cannot be reached by this transport."""

    def _prepare_peer(self, peer: Peer) -> None:
        """Before the Hello: map the receiver's memory, etc. Raise to refuse the connection."""

    def _welcomed(self, peer: Peer, extra: dict) -> None:
        """After the Welcome (e.g. join the NCCL communicator)."""

    def _release_peer(self, peer: Peer) -> None:
        """Unmap / destroy what _prepare_peer and _welcomed made."""

    def _emit(
        self, peer: Peer, out: Outgoing, header: Pages, chunk: pages.Chunk, src: torch.Tensor
    ) -> None:
        """Push transports: gather one chunk of `out` (src: its source block ids) and put it,
        after `header`, on the wire. Raise SendFailed to abandon the send."""
        raise NotImplementedError

    def _write(self, peer: Peer, out: Outgoing) -> int | None:
        """Direct transports: copy the pages into the receiver's mapped pool, synchronously;
        return the digest the Done carries (`_digest_pages`; None with integrity off, or where
        every chunk went `Written` with its own)."""
        raise NotImplementedError

    # -- thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.pool.kv.is_cuda:
                torch.cuda.set_device(self.pool.kv.device)  # Triton and CuPy use the current one
            while True:
                poller = zmq.Poller()
                self._waker.register(poller)
                for peer in self._peers.values():
                    poller.register(peer.sock, zmq.POLLIN)
                    poller.register(peer.monitor, zmq.POLLIN)
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._waker.fd in events:
                    self._waker.drain()
                if self._apply_commands():
                    break
                for peer in list(self._peers.values()):
                    if events.get(peer.monitor):
                        self._watch(peer)
                    if self._peers.get(peer.peer_id) is peer and events.get(peer.sock):
                        self._drain_peer(peer)
                if self._message_faults is not None:  # what an injected fault held back
                    for peer, *frames in self._message_faults.due():
                        self._on_frames(peer, frames)
                self._start_queued()
                self._expire(time.monotonic())
                self._publish_stats()
        except Exception as e:  # the thread must not die silently
            self._die(e)
        finally:
            self._fail_all("sender closed")
            for peer in list(self._peers.values()):
                try:
                    self._drop_peer(peer, "sender closed")
                except Exception:  # close the others regardless
                    log.exception("%s sender: closing peer %s", self.name, peer.peer_id)
            self._publish_stats()

    def _poll_timeout_ms(self) -> int:
        if self._queue:
            return 0
        if self._message_faults is not None:
            return FAULTS_POLL_MS
        deadlines = [o.deadline for o in self._outgoing.values()]
        deadlines += [p.deadline for p in self._peers.values() if not p.welcomed]
        wait = 0.5
        if deadlines:
            wait = min(wait, max(0.0, min(deadlines) - time.monotonic()))
        return max(1, int(wait * 1000))

    def _apply_commands(self) -> bool:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "stop":
                return True
            if cmd[0] == "connect":
                self._start_connect(*cmd[1:])
            elif cmd[0] == "send":
                self._start_or_fail(*cmd[1:])
        return False

    def _fail_pending(self, why: str) -> None:
        self._fail_all(why)

    def _never_applied(self, cmd: tuple, why: str) -> TransferResult | None:
        if cmd[0] != "send":
            return None
        out: Outgoing = cmd[1]
        return TransferResult(out.transfer_id, False, why, out.layers)

    def _publish_stats(self) -> None:
        stats = {
            "outstanding": len(self._outgoing),
            "peers": sum(p.welcomed for p in self._peers.values()),
        }
        with self._stats_lock:
            self._stats = stats
        # Results go out only after the stats that follow them, so a caller that sees a result
        # also sees the state it left (e.g. no outstanding sends).
        self._hand_out()

    # -- results -----------------------------------------------------------------------------
    def _finish(self, out: Outgoing, error: str | None) -> None:
        if self._outgoing.pop(out.send_id, None) is None:
            return
        if error:
            log.warning("%s sender: send of %s failed: %s", self.name, out.transfer_id, error)
        self._finished.append(TransferResult(out.transfer_id, error is None, error, out.layers))

    def _expire(self, now: float) -> None:
        for out in [o for o in self._outgoing.values() if now > o.deadline]:
            peer = self._peers.get(out.peer_id)
            if peer is not None:
                self._fail_send(peer, out, f"timed out after {out.timeout_s}s")
            else:
                self._finish(out, f"timed out after {out.timeout_s}s")
        for peer in [p for p in self._peers.values() if not p.welcomed and now > p.deadline]:
            address = peer.info.get("address")
            self._drop_peer(
                peer,
                f"handshake with {peer.peer_id!r}: no answer from {address} within "
                f"{self.connect_timeout_s}s",
            )

    def _fail_all(self, why: str) -> None:
        for out in list(self._outgoing.values()):
            self._finish(out, why)
        self._queue.clear()
