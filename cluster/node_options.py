"""How a node process joins a cluster: which coordinator, its id, which KV transport and where its
receiver listens, how often it reports. Its engine settings are an `EngineConfig` beside it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class NodeOptions:
    coordinator: str  # the coordinator's node address, tcp://host:port
    node_id: str
    transport: str = "tcp"
    kv_host: str = "127.0.0.1"  # where a decode node's KV receiver listens, as senders reach it
    kv_port: int = 0  # 0: any free port (reported to the coordinator at registration)
    heartbeat_interval_s: float = 0.5
    # Prefill nodes: start a KV send as SendKV arrives (a thread), or between steps.
    kv_handoff: str = "immediate"  # immediate | between-steps
