"""How a node process joins a cluster: which coordinator, its id, which KV transport and where its
receiver listens, how often it reports, which cluster keys it holds, where its traces go. Its
engine settings are an `EngineConfig` beside it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.schema import REQUIRED, setting, validate

TRANSPORTS = ("tcp", "shm", "cuda_ipc", "nccl")
KV_HANDOFF = ("immediate", "between-steps")
# A node's place in the cluster, given by whoever starts it; config files set only the others.
PLACEMENT = ("coordinator", "node_id", "transport", "kv_host", "kv_port")
# The cluster's keys: flags of every command (or the top of a cluster file), never a role's or a
# config file's key, since every process of a cluster must hold the same.
SECURITY = ("cluster_keys", "insecure")
# Where every process of a cluster sends its spans: a flag of every command (or the top of a
# cluster file), as the keys are.
TRACING = ("otlp_traces_endpoint",)


@dataclass(slots=True)
class NodeOptions:
    coordinator: str = setting(REQUIRED, "the coordinator's node address, tcp://HOST:NODE_PORT")
    node_id: str = setting(REQUIRED, "this node's name; a restarted node registers again under it")
    transport: str = setting(
        "tcp",
        "how a decode node receives KV pages (prefill nodes send with each decode node's)",
        choices=TRANSPORTS,
    )
    kv_host: str = setting(
        "127.0.0.1", "where a decode node's KV receiver listens, as senders reach it"
    )
    kv_port: int = setting(
        0, "port of a decode node's KV receiver (0: any free one)", minimum=0, maximum=65535
    )
    heartbeat_interval_s: float = setting(0.5, "how often nodes report their load", above=0)
    kv_handoff: str = setting(
        "immediate",
        "prefill nodes start a KV send as SendKV arrives, on a thread beside the step (immediate), or only between steps (between-steps; for comparison)",
        choices=KV_HANDOFF,
    )

    cluster_keys: str | None = setting(
        None,
        "directory of the cluster key set (pdserve keygen) its sockets use (unset: $PDSERVE_CLUSTER_KEYS, else ~/.config/pdserve/cluster-keys)",
    )
    insecure: bool = setting(
        False,
        "no CurveZMQ: its sockets admit anyone and carry everything in clear (a trusted network only)",
    )
    kv_encryption: bool = setting(
        True,
        "encrypt the KV pages a decode node receives (CurveZMQ); off: senders are still authenticated, pages cross in clear (tcp on a trusted network)",
    )
    kv_integrity: bool = setting(
        True,
        "a prefill node sends a digest of each KV send's pages, which the decode node checks once they have landed (a mismatch fails the handoff and the request is prefilled again); off: pages are not checked",
    )

    otlp_traces_endpoint: str | None = setting(
        None,
        "send OpenTelemetry traces of every request over OTLP to this collector: gRPC (http://HOST:4317), or HTTP for a URL ending in /v1/traces (http://HOST:4318/v1/traces); OTEL_EXPORTER_OTLP_TRACES_PROTOCOL overrides (unset: no tracing)",
    )

    def __post_init__(self) -> None:
        validate(self)
