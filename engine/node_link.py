"""A node's connection to the coordinator: a ZMQ DEALER that registers, sends heartbeats with the
node's load, and hands received messages to the node's loop between steps."""

from __future__ import annotations

import logging
import os
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
        self._last_heartbeat = 0.0

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

    def maybe_heartbeat(self, engine: LLMEngine, pending_transfers: int = 0) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat < self.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        sched = engine.scheduler
        bm = engine.block_manager
        queued = sum(s.num_uncomputed_tokens for s in sched.waiting) + sum(
            s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1
        )
        self.send(
            Heartbeat(
                node_id=self.node_id,
                free_blocks=bm.num_free_blocks,
                total_blocks=bm.num_blocks,
                running=len(sched.running),
                waiting=len(sched.waiting),
                queued_prefill_tokens=queued,
                prefix_hits=bm.prefix_hits,
                prefix_misses=bm.prefix_misses,
                pending_transfers=pending_transfers,
            )
        )

    def close(self) -> None:
        self.sock.close(0)
