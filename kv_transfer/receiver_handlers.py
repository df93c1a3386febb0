"""The receiver's side of the KV control protocol: each sender's message parsed and answered
(Hello: Welcome or Refuse; Begin: Go; Written, Done, Abort; Pages: landed in order per sender).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from pdserve.cluster.codec import MalformedLog, ProtocolError, peer_name
from pdserve.engine.kv.cache import KVLayout
from pdserve.kv_transfer.arrivals import Arrivals, Unit, UnitState
from pdserve.kv_transfer.integrity import ALGORITHMS, IntegrityError
from pdserve.kv_transfer.landing import PageLanding, Payload
from pdserve.kv_transfer.protocol import (
    Abort,
    Begin,
    ControlMessage,
    Done,
    Go,
    Hello,
    Nack,
    Pages,
    Refuse,
    Welcome,
    Written,
    control,
)

log = logging.getLogger(__name__)


class ReceiverHandlers:
    """The handlers of `ZmqReceiver` (mixed into it): they read its state and end its transfers
    through it; the transport hooks (_welcome, _after_welcome, _receive) are its subclasses'."""

    name: str
    layout: KVLayout
    _arrivals: Arrivals
    _landing: PageLanding
    _malformed: MalformedLog
    _inflight: deque[tuple[bytes, Pages, Payload]]
    _peers: set[bytes]
    _integrity: dict[bytes, str | None]
    _max_held_bytes: int

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        try:
            if len(frames) < 2:
                raise ProtocolError("a routing id and no message")
            self._on_message(peer, control.decode(frames[1].buffer), frames[2:])
        except ProtocolError as e:  # logged once per peer, counted after that
            self._malformed(peer_name(peer), str(e))
        except Exception:  # a bug, not junk: it must not stop the receiver either
            log.exception("%s receiver: handling a message from %r failed", self.name, peer)

    def _on_message(self, peer: bytes, msg: ControlMessage, frames: list[zmq.Frame]) -> None:
        if isinstance(msg, Pages):
            self._landing.check_chunk(msg)
            self._inflight.append((peer, msg, self._receive(peer, msg, frames)))
            self._land_ready()
            return
        if frames:
            raise ProtocolError(f"{msg.TYPE} followed by {len(frames)} more frames")
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
        elif isinstance(msg, Begin):
            self._on_begin(peer, msg)
        elif isinstance(msg, Written):
            self._on_written(peer, msg)
        elif isinstance(msg, Done):
            self._on_done(peer, msg)
        elif isinstance(msg, Abort):
            self._on_abort(peer, msg)
        else:
            raise ProtocolError(f"unexpected {msg.TYPE} from a sender")

    def _on_hello(self, peer: bytes, hello: Hello) -> None:
        try:
            if hello.transport != self.name:
                raise ValueError(
                    f"transport mismatch: receiver is {self.name!r}, sender {hello.transport!r}"
                )
            # Head counts may differ: each send names the heads it fills.
            self.layout.check_compatible(hello.layout, ignore=("num_kv_heads",))
            if hello.integrity is not None and hello.integrity not in ALGORITHMS:
                raise ValueError(
                    f"unknown KV digest {hello.integrity!r} (known: {', '.join(ALGORITHMS)})"
                )
            extra = self._welcome(peer, hello)
        except (ValueError, KeyError, TypeError) as e:
            msg = str(e) if isinstance(e, ValueError) else f"bad layout: {e!r}"
            log.warning("%s receiver refuses %s: %s", self.name, hello.sender, msg)
            self._send(peer, Refuse(msg))
            return
        self._peers.add(peer)
        self._integrity[peer] = hello.integrity
        self._send(peer, Welcome(extra))
        try:
            self._after_welcome(peer, extra)
        except Exception:  # the sender's handshake fails in turn (it times out)
            log.exception("%s receiver: handshake with %s failed", self.name, hello.sender)
            self._peers.discard(peer)

    def _open(
        self, peer: bytes, tid: str, send_id: int, dst, layers, timeout_s, direct: bool, heads
    ) -> Unit | None:
        if peer not in self._peers:
            self._send(peer, Nack(tid, send_id, "sender did not complete the handshake"))
            return None
        unit = self._arrivals.open_unit(
            peer,
            send_id,
            tid,
            list(dst),
            tuple(layers),
            timeout_s,
            time.monotonic(),
            direct,
            heads,
        )
        if isinstance(unit, str):
            self._send(peer, Nack(tid, send_id, unit))
            return None
        return unit

    def _on_begin(self, peer: bytes, msg: Begin) -> None:
        unit = self._open(
            peer, msg.transfer_id, msg.send_id, msg.dst, msg.layers, msg.timeout_s, True, msg.heads
        )
        if unit is not None and unit.state is UnitState.OPEN:
            self._grant(unit)

    def _grant(self, unit: Unit) -> None:
        unit.state = UnitState.GRANTED
        self._send(unit.peer, Go(unit.send_id))

    def _on_done(self, peer: bytes, msg: Done) -> None:
        self._write_ended((peer, msg.send_id))
        unit = self._arrivals.units.get((peer, msg.send_id))
        if unit is None or unit.state is not UnitState.GRANTED:
            return  # the transfer already ended; the sender was told
        try:
            if unit.verified < unit.total_pages:  # not checked chunk by chunk: check it whole
                algorithm = self._integrity.get(peer)
                self._landing.check_written(
                    unit, unit.dst_blocks, unit.layers, msg.digest, algorithm
                )
        except IntegrityError as e:
            unit.state = UnitState.OPEN  # its write is over: nothing to drain
            self._integrity_failed(unit, str(e))
            return
        unit.pages = unit.total_pages
        self._close_unit(unit)

    def _on_written(self, peer: bytes, msg: Written) -> None:
        """A chunk of a direct write is in: check it now, while the sender copies the next."""
        unit = self._arrivals.units.get((peer, msg.send_id))
        if unit is None or unit.state is not UnitState.GRANTED:
            return  # the transfer already ended; the sender was told
        try:
            if msg.layers[0] < unit.layers[0] or msg.layers[1] > unit.layers[1]:
                raise ProtocolError(f"a write of layers {list(msg.layers)} outside the send's")
            if msg.hi > len(unit.dst_blocks):
                raise ProtocolError(f"a write of blocks up to {msg.hi} of a send of fewer")
            dst = unit.dst_blocks[msg.lo : msg.hi]
            algorithm = self._integrity.get(peer)
            self._landing.check_written(unit, dst, tuple(msg.layers), msg.digest, algorithm)
        except (IntegrityError, ProtocolError) as e:
            # Its sender may still be copying the next chunks: the end waits for its Done.
            self._integrity_failed(unit, str(e))
            return
        unit.verified += (msg.layers[1] - msg.layers[0]) * (msg.hi - msg.lo)

    def _on_abort(self, peer: bytes, msg: Abort) -> None:
        self._write_ended((peer, msg.send_id))
        unit = self._arrivals.units.get((peer, msg.send_id))
        if unit is not None:
            self._arrivals.drop_unit(unit)
        elif peer not in self._peers:
            return  # a stranger cannot end someone else's transfer
        if msg.transfer_id in self._arrivals.expected:
            self._end(msg.transfer_id, f"sender aborted: {msg.error}", nack=False)

    def _land_ready(self) -> None:
        """Land the pushed chunks whose bytes are in, in order per sender."""
        waiting, self._inflight = self._inflight, deque()
        blocked: set[bytes] = set()
        later = []
        for peer, msg, payload in waiting:
            if peer not in blocked and payload.ready():
                self._on_pages(peer, msg, payload)
            else:
                blocked.add(peer)
                later.append((peer, msg, payload))
        # (a peer lost meanwhile has its chunks dropped)
        self._inflight.extendleft(reversed([e for e in later if e[0] in self._peers]))

    def _on_pages(self, peer: bytes, msg: Pages, payload: Payload) -> None:
        if msg.first:
            unit = self._open(
                peer,
                msg.transfer_id,
                msg.send_id,
                msg.dst,
                msg.send_layers,
                msg.timeout_s,
                False,
                msg.heads,
            )
        else:
            unit = self._arrivals.units.get((peer, msg.send_id))
        if unit is None:
            return  # refused or ended: the sender has its Nack
        if msg.transfer_id != unit.transfer_id:
            self._fail_unit(unit, f"pages of {msg.transfer_id!r} in a send of another transfer")
            return
        if msg.layers[0] < unit.layers[0] or msg.layers[1] > unit.layers[1]:
            self._fail_unit(unit, f"pages of layers {list(msg.layers)} outside the send's")
            return
        if msg.hi > len(unit.dst_blocks):
            self._fail_unit(unit, f"pages of blocks up to {msg.hi} of a send of fewer")
            return
        if msg.heads != unit.heads and not (msg.heads is None and unit.heads is None):
            self._fail_unit(unit, f"pages of heads {msg.heads} in a send of heads {unit.heads}")
            return
        if unit.state is UnitState.WAITING:
            if self._arrivals.held_bytes + msg.nbytes > self._max_held_bytes:
                self._arrivals.drop_unit(unit)
                self._send(
                    peer,
                    Nack(unit.transfer_id, unit.send_id, "receiver holds too much unexpected data"),
                )
                return
            unit.held.append((msg, payload))
            unit.held_bytes += msg.nbytes
            return
        self._land(unit, msg, payload)
