"""A node's connection to the coordinator: a ZMQ DEALER that registers and hands received orders
to the node's loop between steps, and a heartbeat thread that reports the node's load on a socket
of its own, so a long step never makes a busy node look dead. Orders and reports travel in a link
session (`cluster/link_session.py`): each arrives once, in order, even if a message is lost or
repeated on the way; load reports need none (each is a whole snapshot)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from pdserve.cluster.codec import MalformedLog
from pdserve.cluster.keys import HANDSHAKE_FAILED, ClusterKeys, curve_client
from pdserve.cluster.node_messages import (
    Heartbeat,
    Message,
    Register,
    RequestError,
    orders,
    reports,
)
from pdserve.cluster.session_socket import SessionSocket

logger = logging.getLogger(__name__)

# How long a report to the coordinator may wait for room in the link's queue (1000 messages,
# which fill only while the coordinator takes none: it is gone, or stalled that long).
SEND_TIMEOUT_S = 60.0


class CoordinatorUnreachable(RuntimeError):
    """The coordinator has taken none of this node's reports for the link's send timeout."""


class NodeLink:
    def __init__(
        self,
        coordinator_addr: str,
        node_id: str,
        heartbeat_interval_s: float,
        keys: ClusterKeys | None = None,
        send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        """keys: the cluster key set the coordinator admits (None: a coordinator run insecure);
        send_timeout_s: how long a report waits for room before CoordinatorUnreachable."""
        self.node_id = node_id
        self.coordinator_addr = coordinator_addr
        self.heartbeat_interval_s = heartbeat_interval_s
        self.keys = keys
        self.send_timeout_s = send_timeout_s
        self.ctx = zmq.Context.instance()
        self.sock = self.dealer(node_id)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout_s * 1000)))
        self.sock.connect(coordinator_addr)
        self.malformed = MalformedLog(logger, f"node {node_id}")
        self.session = SessionSocket(self.sock, f"node {node_id} link", self.malformed)
        self._last_load = 0.0
        self._load: Heartbeat | None = None
        self._stopped = threading.Event()
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, daemon=True)

    def dealer(self, identity: str) -> zmq.Socket:
        """A socket of this node for the coordinator (keyed as the link is), not yet connected."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            curve_client(sock, self.keys)
        return sock

    def register(self, msg: Register) -> None:
        # The heartbeat thread watches the handshake from now on: a registration a coordinator
        # of other keys never takes blocks below, and the refusal must be told meanwhile.
        self._start_heartbeats()
        self.send(msg)

    def send(self, msg: Message) -> None:
        """Queue a report; CoordinatorUnreachable (which ends the node: its supervisor starts it
        afresh, and it registers once the coordinator is back) if the queue stays full."""
        try:
            self.session.send(reports.encode(msg))
        except zmq.Again:
            raise CoordinatorUnreachable(
                f"the coordinator at {self.coordinator_addr} has taken none of node "
                f"{self.node_id}'s reports for {self.send_timeout_s:g}s (gone, or stalled); "
                "the node stops"
            ) from None

    def receive(self, timeout_ms: int) -> list[Message]:
        """Every order waiting now, after waiting up to timeout_ms for the first; malformed
        frames (of any shape) are dropped and logged once. Sends what the session owes (resends,
        an acknowledgement)."""
        messages = self.session.receive(timeout_ms, orders)
        for msg in messages:
            logger.debug("[%s] received %s", getattr(msg, "request_id", "-"), msg.TYPE)
        return messages

    def carry_out(self, msg: Message, handle: Callable[[Message], None]) -> None:
        """handle(msg) on the node's loop: an order that cannot be carried out is logged and, if
        it concerns a request, reported failed (the coordinator retries it elsewhere); it never
        ends the loop."""
        try:
            handle(msg)
        except Exception:
            request_id = getattr(msg, "request_id", None)
            logger.exception("[%s] handling %s failed", request_id or "-", msg.TYPE)
            if request_id is not None:
                self.send(RequestError(request_id, f"{msg.TYPE} failed on node {self.node_id}"))

    def load_due(self, now: float | None = None) -> bool:
        """Whether a fresh load snapshot is wanted (at most one per heartbeat interval)."""
        now = time.monotonic() if now is None else now
        return self._load is None or now - self._last_load >= self.heartbeat_interval_s

    def set_load(self, load: Heartbeat) -> None:
        """The snapshot the heartbeat thread reports from now on (its seq is set here)."""
        self._last_load = time.monotonic()
        seq = (self._load.seq + 1) if self._load is not None else 1
        link = self.session.session
        self._load = msgspec.structs.replace(
            load,
            node_id=self.node_id,
            seq=seq,
            link_session=link.session,
            link_sent=link.next_seq - 1,
        )
        self._start_heartbeats()

    def _start_heartbeats(self) -> None:
        if self._heartbeats.ident is None and not self._stopped.is_set():
            self._heartbeats.start()  # once: it lives until close(); sends loads once set

    def _heartbeat_loop(self) -> None:
        sock = self.dealer(f"{self.node_id}/heartbeat")
        # Watched from before it connects: a refused handshake may not be tried again.
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        sock.connect(self.coordinator_addr)
        refused = False
        try:
            while not self._stopped.wait(self.heartbeat_interval_s):
                load = self._load
                if load is not None:
                    with contextlib.suppress(zmq.Again):  # no connection now (refused, or a
                        sock.send(reports.encode(load), zmq.NOBLOCK)  # coordinator restarting)
                if monitor.poll(0) and not refused:
                    refused = True  # once: ZeroMQ retries on its own, and so may the operator
                    logger.error(
                        "the coordinator at %s refuses this node's handshake: the two do not "
                        "hold the same cluster keys (give --cluster-keys DIR with the "
                        "coordinator's key set, or run both --insecure); retrying",
                        self.coordinator_addr,
                    )
        except zmq.ZMQError:
            pass
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def close(self) -> None:
        self._stopped.set()
        if self._heartbeats.is_alive():
            self._heartbeats.join(2)
        self.sock.close(0)


def stop_on_signals(node: object) -> None:
    """SIGTERM or SIGINT ends a node's loop after its current step (node.running = False)."""

    def stop(signum: int, frame: object) -> None:  # noqa: ARG001
        node.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
