"""How a node process is started: which coordinator, which role and index, which model and
transport, and its engine settings. Parsed from the command line by `pdserve`."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(slots=True)
class NodeOptions:
    coordinator: str  # the coordinator's node address, tcp://host:port
    node_id: str
    transport: str = "tcp"
    kv_host: str = "127.0.0.1"  # where a decode node's KV receiver listens, as senders reach it
    kv_port: int = 0  # 0: any free port (reported to the coordinator at registration)
    heartbeat_interval_s: float = 0.5
    transfer_timeout_s: float = 30.0
    # Prefill nodes: start a KV send as SendKV arrives (a thread), or between steps.
    kv_handoff: str = "immediate"  # immediate | between-steps
    engine: EngineConfig = field(default_factory=EngineConfig)
