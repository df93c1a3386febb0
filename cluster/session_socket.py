"""A node's DEALER to the coordinator speaking a link session (`cluster/link_session.py`), with
the faults configured for it (`cluster/faults.py`) applied to what it receives: what the node
link and a prefill node's handoff socket each are."""

from __future__ import annotations

import contextlib
import time

import zmq

from pdserve.cluster.codec import Codec, MalformedLog, Message, ProtocolError
from pdserve.cluster.faults import message_faults
from pdserve.cluster.link_session import LinkSession


class SessionSocket:
    def __init__(self, sock: zmq.Socket, where: str, malformed: MalformedLog) -> None:
        """sock: a DEALER (its send timeout is the caller's); where: its name in the logs and
        in the faults' seeds."""
        self.sock = sock
        self.malformed = malformed
        self.session = LinkSession(strict=True)
        self.faults = message_faults(where)

    def send(self, frame: bytes) -> None:
        """Send a message (an encoded frame) in the session; zmq.Again as the socket raises it."""
        self.sock.send_multipart(self.session.wrap(frame, time.monotonic()))

    def receive(self, timeout_ms: int, codec: Codec) -> list[Message]:
        """Every message the session hands on now, after waiting up to timeout_ms for the first
        frames; frames and messages that do not decode are dropped and logged once. Then send
        what the session owes (resends, an acknowledgement)."""
        arrived = self.faults.due() if self.faults is not None else []
        if arrived or self.sock.poll(timeout_ms):
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                arrived += [frames] if self.faults is None else self.faults.arrive(frames)
        now = time.monotonic()
        messages = []
        for frames in arrived:
            try:
                bodies = self.session.unwrap(frames, now)
            except ProtocolError as exc:
                self.malformed("coordinator", str(exc))
                continue
            for body in bodies:
                try:
                    messages.append(codec.decode(body))
                except ProtocolError as exc:
                    self.malformed("coordinator", str(exc))
        self.flush(now)
        return messages

    def flush(self, now: float | None = None) -> None:
        """Send what the session owes now (never blocking: a full queue waits for the next)."""
        for frames in self.session.due(time.monotonic() if now is None else now):
            with contextlib.suppress(zmq.Again):
                self.sock.send_multipart(frames, zmq.NOBLOCK)
