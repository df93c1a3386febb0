"""A node's connection to the coordinator: a ZMQ DEALER that registers and hands received messages
to the node's loop between steps, and a heartbeat thread that reports the node's load on a socket
of its own, so a long step never makes a busy node look dead."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import zmq

from engine import protocol
from engine.llm_engine import LLMEngine
from engine.protocol import Heartbeat, Message, Register

logger = logging.getLogger(__name__)


class NodeLink:
    def __init__(
        self,
        coordinator_addr: str,
        node_id: str,
        role: str,
        heartbeat_interval_s: float = 0.5,
    ) -> None:
        self.node_id = node_id
        self.role = role
        self.heartbeat_interval_s = heartbeat_interval_s
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, node_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(coordinator_addr)
        self.coordinator_addr = coordinator_addr
        self._last_load = 0.0
        self._load: Heartbeat | None = None
        self._stopped = threading.Event()
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, daemon=True)

    def register(
        self, engine: LLMEngine, transport: str, receiver_info: dict | None = None
    ) -> None:
        self.send(
            Register(
                node_id=self.node_id,
                role=self.role,
                model=str(engine.config.model or "pdserve-tiny"),
                kv_layout=engine.layout.to_dict(),
                num_blocks=engine.block_manager.num_blocks,
                max_model_len=engine.max_model_len,
                transport=transport,
                receiver_info=receiver_info or {},
                pid=os.getpid(),
            )
        )

    def send(self, msg: Message) -> None:
        self.sock.send(protocol.encode(msg))

    def receive(self, timeout_ms: int) -> list[Message]:
        """Every message waiting now, after waiting up to timeout_ms for the first."""
        messages: list[Message] = []
        if not self.sock.poll(timeout_ms):
            return messages
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            msg = protocol.decode_or_log(frame, "coordinator")
            if msg is not None:
                messages.append(msg)

    def update_load(self, engine: LLMEngine, pending_transfers: int = 0) -> None:
        """Refresh the load the heartbeat thread reports (at most once per interval)."""
        now = time.monotonic()
        if self._load is not None and now - self._last_load < self.heartbeat_interval_s:
            return
        self._last_load = now
        sched = engine.scheduler
        bm = engine.block_manager
        queued = sum(s.num_uncomputed_tokens for s in sched.waiting) + sum(
            s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1
        )
        self._load = Heartbeat(
            node_id=self.node_id,
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            running=len(sched.running),
            waiting=len(sched.waiting),
            queued_prefill_tokens=queued,
            prefix_hits=bm.prefix_hits,
            prefix_misses=bm.prefix_misses,
            pending_transfers=pending_transfers,
            seq=(self._load.seq + 1) if self._load is not None else 1,
        )
        if not self._heartbeats.is_alive():
            self._heartbeats.start()

    def _heartbeat_loop(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.node_id}/heartbeat".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.coordinator_addr)
        try:
            while not self._stopped.wait(self.heartbeat_interval_s):
                if self._load is not None:
                    sock.send(protocol.encode(self._load), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
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
