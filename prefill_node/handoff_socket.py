"""A prefill node's handoff socket: a thread that takes SendKV from the coordinator and starts the
KV send at once, while the node's loop may be in the middle of a long prefill step.

Without it a prefilled sequence's KV leaves only after the step that follows its first token: on
a busy prefill node that whole step is added to the gap between the request's first and second
tokens. The socket has its own identity (`<node id>/handoff`); it announces itself with
HandoffReady, and the coordinator then sends SendKV there. Every other message still reaches the
node's main socket and is handled between steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from pdserve.cluster.codec import MalformedLog
from pdserve.cluster.keys import ClusterKeys, curve_client
from pdserve.cluster.node_messages import HandoffReady, SendKV, orders, reports
from pdserve.cluster.session_socket import SessionSocket

logger = logging.getLogger(__name__)

POLL_MS = 20


class HandoffSocket:
    def __init__(
        self,
        coordinator_addr: str,
        node_id: str,
        on_send_kv: Callable[[SendKV], None],
        keys: ClusterKeys | None = None,
    ) -> None:
        """on_send_kv runs on the listener's thread: it must be safe to call beside the step.
        keys: the cluster key set the coordinator admits (None: a coordinator run insecure)."""
        self.coordinator_addr = coordinator_addr
        self.keys = keys
        self.node_id = node_id
        self.on_send_kv = on_send_kv
        self._announce = threading.Event()
        self._stopped = threading.Event()
        self._malformed = MalformedLog(logger, f"handoff socket of {node_id}")
        self._thread = threading.Thread(target=self._run, name="kv-handoff", daemon=True)

    def start(self) -> None:
        self._announce.set()
        self._thread.start()

    def announce(self) -> None:
        """Say HandoffReady again (after the node re-registers with a coordinator)."""
        self._announce.set()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.node_id}/handoff".encode())
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            curve_client(sock, self.keys)
        sock.connect(self.coordinator_addr)
        session = SessionSocket(sock, f"handoff socket of {self.node_id}", self._malformed)
        try:
            while not self._stopped.is_set():
                if self._announce.is_set():
                    self._announce.clear()
                    session.send(reports.encode(HandoffReady(self.node_id)))
                for msg in session.receive(POLL_MS, orders):
                    if isinstance(msg, SendKV):
                        try:
                            self.on_send_kv(msg)
                        except Exception:  # the socket outlives one bad send
                            logger.exception("[%s] starting the KV send failed", msg.request_id)
                    else:
                        logger.warning("handoff socket ignores %s", msg.TYPE)
        except zmq.ZMQError as exc:
            if not self._stopped.is_set():
                logger.error("handoff socket failed: %s", exc)
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(2)
