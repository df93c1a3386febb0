"""One end of a node link's session: the messages each side sends arrive at the other once each,
in order, though a message may be lost, delayed, duplicated or reordered on the way (a dropped
connection, an injected fault: `cluster/faults.py`).

Each message travels as two frames, `[header, message]`. The header names the sender's session
(a random number per process, or per incarnation of a link), the message's sequence number, the
lowest one the sender still holds unacknowledged (`base`), and what the sender has received of
the other side's session (`ack`: every message up to it); it ends with a digest of itself and
the message, so a message cut or changed on the way is refused before it takes its number. The
receiver hands on messages in sequence order, holds those that came early, and drops duplicates;
the sender resends whatever stays unacknowledged for `resend_after_s`. A header with sequence 0
and an empty message only acknowledges.

A receiver meeting a session it has not seen (the other side restarted) starts it at that
session's `base`: what came before was delivered to an earlier incarnation of this side. A
message from a session it has left behind is dropped. With `strict`, a side takes only messages
addressed to its own session (acknowledging it); a node is strict, so the orders a coordinator
kept for an earlier incarnation of the node never reach a new one.
"""

from __future__ import annotations

import secrets
import struct
from collections import OrderedDict, deque

import xxhash

from pdserve.cluster.codec import DIGEST_BYTES, ProtocolError

HEADER = struct.Struct("<QQQQQ")  # session, seq, base, peer session, ack
HEADER_BYTES = HEADER.size + DIGEST_BYTES
RESEND_AFTER_S = 0.3
ACK_AFTER_S = 0.02
MAX_EARLY = 4096  # messages held for a gap before it; more are dropped (and resent later)
MAX_UNACKED = 65536  # messages kept for resending; past it the oldest are given up
RETIRED_SESSIONS = 16


def new_session() -> int:
    return secrets.randbits(63) | 1


class LinkSession:
    def __init__(
        self,
        session: int | None = None,
        strict: bool = False,
        resend_after_s: float = RESEND_AFTER_S,
        ack_after_s: float = ACK_AFTER_S,
    ) -> None:
        self.session = session or new_session()
        self.strict = strict
        self.resend_after_s = resend_after_s
        self.ack_after_s = ack_after_s
        self.next_seq = 1
        self.unacked: OrderedDict[int, list] = OrderedDict()  # seq -> [message, last sent]
        self.peer_session = 0
        self.expected = 1  # the next of the peer's messages to hand on
        self.early: dict[int, bytes] = {}
        self.retired: deque[int] = deque(maxlen=RETIRED_SESSIONS)
        self.ack_owed_since: float | None = None
        self.resent = 0  # messages sent again (a count for tests and logs)
        self.duplicates = 0  # messages received again and dropped

    # -- sending -------------------------------------------------------------------------------
    def wrap(self, message: bytes, now: float) -> list[bytes]:
        """The frames that send a new message (kept until the peer acknowledges it)."""
        seq = self.next_seq
        self.next_seq += 1
        self.unacked[seq] = [message, now]
        if len(self.unacked) > MAX_UNACKED:
            self.unacked.popitem(last=False)
        self.ack_owed_since = None  # the header acknowledges
        return [self._header(seq, message), message]

    def due(self, now: float) -> list[list[bytes]]:
        """What to send now though nothing new is: messages unacknowledged for resend_after_s,
        and an acknowledgement owed for ack_after_s."""
        out = []
        for seq, entry in self.unacked.items():
            if now - entry[1] >= self.resend_after_s:
                entry[1] = now
                out.append([self._header(seq, entry[0]), entry[0]])
                self.resent += 1
        if out:
            self.ack_owed_since = None
        elif self.ack_owed_since is not None and now - self.ack_owed_since >= self.ack_after_s:
            out.append(self.acknowledgement())
        return out

    def acknowledgement(self) -> list[bytes]:
        """The frames of an acknowledgement-only message, sent now whether one is owed or not
        (the coordinator checks with one that a node's socket is still connected)."""
        self.ack_owed_since = None
        return [self._header(0, b""), b""]

    def forget_sent(self) -> None:
        """Give up what is unacknowledged (the peer is gone; a new one starts afresh)."""
        self.unacked.clear()

    def _header(self, seq: int, message: bytes) -> bytes:
        base = next(iter(self.unacked), self.next_seq)
        fields = HEADER.pack(self.session, seq, base, self.peer_session, self.expected - 1)
        return fields + _digest(fields, message)

    # -- receiving -----------------------------------------------------------------------------
    def unwrap(self, frames: list, now: float) -> list[bytes]:
        """The messages now to hand on, in order, for the frames of one received message (none
        for a duplicate, an early one or an acknowledgement); ProtocolError for frames that are
        not a session's."""
        if len(frames) != 2:
            raise ProtocolError(f"{len(frames)} frames, expected a session header and a message")
        header, message = _view(frames[0]), _view(frames[1])
        if (
            len(header) != HEADER_BYTES
            or _digest(header[: HEADER.size], message) != header[HEADER.size :]
        ):
            raise ProtocolError("not a session's message (or one cut or changed on the way)")
        session, seq, base, peer_session, ack = HEADER.unpack(header[: HEADER.size])
        if session in self.retired:
            return []
        if self.strict and peer_session not in (0, self.session):
            return []  # meant for another incarnation of this side
        if peer_session == self.session:
            while self.unacked and next(iter(self.unacked)) <= ack:
                self.unacked.popitem(last=False)
        if session != self.peer_session:
            if self.peer_session:  # the peer restarted: what was kept for it is moot
                self.retired.append(self.peer_session)
                self.forget_sent()
            self.peer_session, self.expected = session, base
            self.early.clear()
        out = self._skip_to(base)  # the peer gave up messages before base (MAX_UNACKED)
        if seq == 0:
            return out
        if self.ack_owed_since is None:
            self.ack_owed_since = now
        if seq < self.expected:
            self.duplicates += 1
            return out
        message = bytes(message)
        if seq > self.expected:
            if len(self.early) < MAX_EARLY:
                self.early[seq] = message
            return out
        self.expected += 1
        return [*out, message, *self._in_order()]

    def _skip_to(self, base: int) -> list[bytes]:
        if base <= self.expected:
            return []
        self.early = {seq: m for seq, m in self.early.items() if seq >= base}
        self.expected = base
        return self._in_order()

    def _in_order(self) -> list[bytes]:
        out = []
        while self.expected in self.early:
            out.append(self.early.pop(self.expected))
            self.expected += 1
        return out


def _digest(fields: memoryview | bytes, message: memoryview | bytes) -> bytes:
    h = xxhash.xxh3_64(fields)
    h.update(message)
    return h.digest()


def _view(frame: object) -> memoryview:
    return memoryview(frame if isinstance(frame, bytes) else getattr(frame, "bytes", frame))
