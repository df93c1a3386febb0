"""The sender's peers (its receivers): connecting and the handshake, watching each connection,
dropping a peer that leaves, refuses or fails, and the messages that come back from them.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket as pysocket
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.cluster.codec import MalformedLog, ProtocolError
from pdserve.cluster.keys import HANDSHAKE_FAILED, ClusterKeys
from pdserve.engine.kv.cache import KVLayout
from pdserve.kv_transfer.channel import configure, secure_dealer
from pdserve.kv_transfer.outgoing import Outgoing, SendFailed, SendState
from pdserve.kv_transfer.protocol import (
    MAX_CONTROL_BYTES,
    Ack,
    ControlMessage,
    Go,
    Hello,
    Nack,
    Ping,
    Refuse,
    Welcome,
    control,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Peer:
    peer_id: str
    info: dict
    sock: zmq.Socket
    monitor: zmq.Socket
    deadline: float  # of the handshake
    welcomed: bool = False
    waiting: list[Outgoing] = field(default_factory=list)  # sends made before the Welcome
    extra: dict = field(default_factory=dict)  # what the transport keeps per peer


class SenderPeers:
    """The peer lifecycle of `ZmqSender` (mixed into it): its thread calls these, and they end
    the sends of a peer that goes through it; the transport hooks (_prepare_peer, _welcomed,
    _release_peer) are its subclasses'."""

    name: str
    identity: str
    integrity: str | None
    keys: ClusterKeys | None
    layout: KVLayout
    connect_timeout_s: float
    _ctx: zmq.Context
    _connections: itertools.count
    _peers: dict[str, Peer]
    _outgoing: dict[int, Outgoing]
    _queue: deque[Outgoing]
    _malformed: MalformedLog

    def _start_connect(self, peer_id: str, info: dict) -> None:
        old = self._peers.get(peer_id)
        if old is not None:
            if old.info == info:
                return  # already connected or connecting there
            self._drop_peer(old, f"receiver {peer_id!r} moved to {info.get('address')}")
        sock = self._ctx.socket(zmq.DEALER)
        configure(sock, MAX_CONTROL_BYTES)  # only control messages come back
        # A fresh id per connection: a ROUTER refuses an id it still holds for a dropped one.
        sock.setsockopt(zmq.ROUTING_ID, f"{self.identity}-{next(self._connections)}".encode())
        secure_dealer(sock, self.keys, info)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | HANDSHAKE_FAILED
        )
        peer = Peer(peer_id, info, sock, monitor, time.monotonic() + self.connect_timeout_s)
        self._peers[peer_id] = peer
        try:
            self._prepare_peer(peer)
            sock.connect(info["address"])
            hello = Hello(
                self.identity,
                self.name,
                self.layout,
                pysocket.gethostname(),
                os.getpid(),
                self.integrity,
            )
            sock.send(control.encode(hello))
        except Exception as e:  # fails the sends waiting for this peer
            self._drop_peer(peer, f"connecting to {peer_id!r} failed: {e}")

    def _watch(self, peer: Peer) -> None:
        while True:
            try:
                event = recv_monitor_message(peer.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._drop_peer(peer, f"receiver {peer.peer_id!r} disconnected")
                return
            if event["event"] & HANDSHAKE_FAILED:
                self._drop_peer(
                    peer,
                    f"receiver {peer.peer_id!r} refused the handshake: it does not admit "
                    "this node's cluster keys (every process of a cluster needs the same)",
                )
                return

    def _check_peer(self, peer: Peer, out: Outgoing) -> None:
        """Between chunks of a long send: raise SendFailed if the peer left or time is up."""
        self._watch(peer)
        if self._closed:
            raise SendFailed("sender closed")
        if self._peers.get(peer.peer_id) is not peer:
            raise SendFailed(f"receiver {peer.peer_id!r} disconnected")
        if time.monotonic() > out.deadline:
            raise SendFailed(f"timed out after {out.timeout_s}s")

    def _drop_peer(self, peer: Peer, why: str) -> None:
        """Forget a peer: fail its sends, close its socket (freeing queued frames) and memory."""
        if self._peers.get(peer.peer_id) is peer:
            del self._peers[peer.peer_id]
        if not self._closed and self._failure is None:
            log.warning("%s sender: dropped peer %s: %s", self.name, peer.peer_id, why)
        for out in [o for o in self._outgoing.values() if o.peer_id == peer.peer_id]:
            self._finish(out, why)
        for out in [o for o in self._queue if o.peer_id == peer.peer_id]:
            self._queue.remove(out)
        try:
            self._release_peer(peer)
        except Exception:  # best effort while tearing down
            log.exception("%s sender: releasing peer %s", self.name, peer.peer_id)
        peer.sock.disable_monitor()
        peer.monitor.close(linger=0)
        peer.sock.close(linger=0)

    def _drain_peer(self, peer: Peer) -> None:
        while self._peers.get(peer.peer_id) is peer:
            try:
                frames = peer.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._message_faults is None:
                self._on_frames(peer, frames)
            else:
                for held_peer, *arrived in self._message_faults.arrive([peer, *frames], skip=1):
                    self._on_frames(held_peer, arrived)

    def _on_frames(self, peer: Peer, frames: list[bytes]) -> None:
        if self._peers.get(peer.peer_id) is not peer:
            return  # (held back by an injected fault, and the peer is gone since)
        try:
            self._on_message(peer, control.decode_frames(frames))
        except ProtocolError as e:  # logged once per receiver, counted after that
            self._malformed(peer.peer_id, str(e))
        except Exception:  # a bug, not junk: it must not stop the sender either
            log.exception("%s sender: handling a message from %s failed", self.name, peer.peer_id)

    def _send_to(self, peer: Peer, msg: ControlMessage) -> None:
        peer.sock.send(control.encode(msg), flags=zmq.NOBLOCK)

    def _on_message(self, peer: Peer, msg: ControlMessage) -> None:
        if isinstance(msg, Welcome):
            if peer.welcomed:
                raise ProtocolError("a second Welcome")
            try:
                self._welcomed(peer, msg.extra)
            except Exception as e:  # fails the sends waiting for the handshake
                self._drop_peer(peer, f"handshake with {peer.peer_id!r} failed: {e!r}")
                return
            peer.welcomed = True
            waiting, peer.waiting = peer.waiting, []
            for out in waiting:
                if out.send_id in self._outgoing:
                    self._start_or_fail(out, peer.info)
        elif isinstance(msg, Refuse):
            self._drop_peer(peer, f"refused by receiver {peer.peer_id!r}: {msg.error}")
        elif isinstance(msg, Ack):
            out = self._outgoing.get(msg.send_id)
            if out is not None:
                self._finish(out, None)
        elif isinstance(msg, Nack):
            out = self._outgoing.get(msg.send_id)
            if out is not None:
                self._finish(out, f"refused by receiver: {msg.error}")
        elif isinstance(msg, Go):
            out = self._outgoing.get(msg.send_id)
            if out is not None and out.state is SendState.AWAITING_GO:
                self._do_write(peer, out)
        elif not isinstance(msg, Ping):
            raise ProtocolError(f"unexpected {msg.TYPE} from a receiver")
