"""The coordinator's configuration (TOML): how operators trade time-to-first-token against
time-per-output-token. Fields marked live are re-read on SIGHUP; the others need a restart."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

PREFILL_ROUTING = ("least_loaded", "prefix_affinity")
DECODE_ROUTING = ("kv_capacity",)
KV_HANDOFF = ("immediate", "between-steps")


def _live(default, doc: str):  # noqa: ANN001, ANN202
    return field(default=default, metadata={"live": True, "doc": doc})


def _fixed(default, doc: str):  # noqa: ANN001, ANN202
    return field(default=default, metadata={"live": False, "doc": doc})


@dataclass(slots=True)
class CoordinatorConfig:
    # Routing and admission (live).
    prefill_routing: str = _live(
        "prefix_affinity", "prefill node choice: least_loaded | prefix_affinity"
    )
    decode_routing: str = _live(
        "kv_capacity", "decode node choice: kv_capacity (most free KV blocks)"
    )
    admission_watermark: float = _live(
        0.05,
        "fraction of a decode node's KV blocks kept free at admission, for its running sequences to grow into",
    )
    max_pending_requests: int = _live(
        512, "requests not yet decoding beyond which new ones get an 'overloaded' error"
    )
    conditional_disagg_threshold: int = _live(
        0, "prompts shorter than this many tokens are prefilled on the decode node (0: never)"
    )
    prefill_queue_limit_tokens: int = _live(
        0,
        "when every prefill node has more queued prompt tokens than this, prefill on the decode node (0: never)",
    )
    prefix_affinity_min_blocks: int = _live(
        1, "full blocks a prompt must share with a cached prefix for affinity routing to apply"
    )
    prefix_affinity_max_load_ratio: float = _live(
        2.0,
        "affinity yields to least-loaded when the cached node's queue exceeds this multiple of the least-loaded node's plus the cached prefix length",
    )
    heartbeat_timeout_s: float = _live(
        3.0, "a node silent this long is marked dead and its requests move elsewhere"
    )
    max_retries: int = _live(
        3, "times a request is re-prefilled after node failures before it fails"
    )
    transfer_timeout_s: float = _live(
        30.0, "a KV handoff not finished in this time fails and is retried"
    )
    # Node settings, passed to nodes at start (restart to change).
    heartbeat_interval_s: float = _fixed(0.5, "how often nodes report their load")
    block_size: int = _fixed(16, "tokens per KV block")
    max_num_seqs: int = _fixed(256, "sequences per step on a node")
    max_num_batched_tokens: int = _fixed(
        2048, "tokens per step on a node (the chunked-prefill chunk)"
    )
    num_kv_blocks: int | None = _fixed(
        None, "KV blocks per node (default: from kv_cache_bytes or gpu_memory_utilization)"
    )
    kv_cache_bytes: int | None = _fixed(
        None, "CPU KV pool budget per node in bytes (default 1 GiB)"
    )
    gpu_memory_utilization: float = _fixed(
        0.9, "fraction of free GPU memory a node's KV pool takes"
    )
    enable_prefix_caching: bool = _fixed(True, "reuse KV of shared prompt prefixes")
    max_model_len: int | None = _fixed(None, "context limit (default: the model's)")
    scheduling_policy: str = _fixed(
        "continuous",
        "node step loops: continuous (admit whenever there is room) or static (a batch runs until all of it finished; the baseline)",
    )
    kv_handoff: str = _fixed(
        "immediate",
        "prefill nodes start a KV send as SendKV arrives, on a thread beside the step (immediate), or only between steps (between-steps; for comparison)",
    )
    kernel_backend: str = _fixed(
        "auto",
        "attention/norm/rotary kernels: auto (Triton on CUDA) | torch (the reference) | triton",
    )
    enforce_eager: bool = _fixed(False, "run decode steps eagerly, never from CUDA graphs")
    cuda_graph_max_batch_size: int = _fixed(
        256, "largest decode batch captured as a CUDA graph (capped at max_num_seqs)"
    )

    def __post_init__(self) -> None:
        if self.prefill_routing not in PREFILL_ROUTING:
            raise ValueError(
                f"prefill_routing must be one of {PREFILL_ROUTING}, got {self.prefill_routing!r}"
            )
        if self.kv_handoff not in KV_HANDOFF:
            raise ValueError(f"kv_handoff must be one of {KV_HANDOFF}, got {self.kv_handoff!r}")
        if self.decode_routing not in DECODE_ROUTING:
            raise ValueError(
                f"decode_routing must be one of {DECODE_ROUTING}, got {self.decode_routing!r}"
            )
        if not 0 <= self.admission_watermark < 1:
            raise ValueError(
                f"admission_watermark must be in [0, 1), got {self.admission_watermark}"
            )
        for name in (
            "max_pending_requests",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("heartbeat_timeout_s", "heartbeat_interval_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_toml(cls, path: str | Path) -> CoordinatorConfig:
        data = tomllib.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown config key '{unknown[0]}'")
        return cls(**data)

    def reload_from(self, new: CoordinatorConfig) -> list[str]:
        """Apply the live fields of `new`; returns the names changed. Fixed fields that differ
        are left alone (they need a restart) and reported in the log by the caller."""
        changed = []
        for f in dataclasses.fields(self):
            if f.metadata.get("live") and getattr(self, f.name) != getattr(new, f.name):
                setattr(self, f.name, getattr(new, f.name))
                changed.append(f.name)
        return changed

    def fixed_differences(self, new: CoordinatorConfig) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(self)
            if not f.metadata.get("live") and getattr(self, f.name) != getattr(new, f.name)
        ]

    def engine_options(self) -> dict:
        """What nodes are started with."""
        names = ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                 "kv_cache_bytes", "gpu_memory_utilization", "enable_prefix_caching",
                 "max_model_len", "scheduling_policy", "kernel_backend", "enforce_eager",
                 "cuda_graph_max_batch_size")  # fmt: skip
        return {n: getattr(self, n) for n in names}
