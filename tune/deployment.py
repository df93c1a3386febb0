"""One candidate deployment: how many prefill and decode nodes (or colocated workers), and the
settings the tuner searches, as the coordinator config and engine settings pdserve reads."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdserve.coordinator.config import CoordinatorConfig
from pdserve.engine.config import EngineConfig

# Long enough that every prompt is prefilled where it decodes: a colocated deployment written
# as decode-only nodes (the cluster file has no colocated workers).
ALL_LOCAL = 1 << 30


@dataclass(frozen=True, slots=True)
class Deployment:
    prefill: int  # prefill nodes; 0 with colocated
    decode: int  # decode nodes, or colocated workers
    colocated: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    admission_watermark: float = 0.05
    conditional_disagg_threshold: int = 0
    local_prefill_max_uncached_tokens: int = 0
    prefill_tp: int = 1  # devices a prefill node (tensor_parallel_size)
    decode_tp: int = 1  # devices a decode node, or a colocated worker

    def __post_init__(self) -> None:
        if self.colocated and self.prefill:
            raise ValueError("a colocated deployment has no prefill nodes")
        if self.colocated and self.prefill_tp != self.decode_tp:
            raise ValueError("a colocated deployment has one tensor-parallel size: decode_tp")
        if min(self.prefill_tp, self.decode_tp) < 1:
            raise ValueError("tensor-parallel sizes must be at least 1")
        if self.decode < 1 or (not self.colocated and self.prefill < 1):
            raise ValueError(
                f"{self.label}: needs decode nodes, and prefill nodes unless colocated"
            )
        EngineConfig(**self.engine_settings())  # the engine's own checks
        CoordinatorConfig(**self.coordinator_settings())

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode

    @property
    def devices(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def tp(self) -> str:
        """The tensor-parallel sizes, prefill / decode (colocated: the one)."""
        return str(self.decode_tp) if self.colocated else f"{self.prefill_tp} / {self.decode_tp}"

    @property
    def placement(self) -> str:
        if self.colocated:
            text = f"{self.decode} colocated"
            return text + (f" x TP{self.decode_tp}" if self.decode_tp > 1 else "")
        if self.prefill_tp == self.decode_tp == 1:
            text = f"{self.prefill}P + {self.decode}D"
        else:
            text = f"{self.prefill}P x TP{self.prefill_tp} + {self.decode}D x TP{self.decode_tp}"
        if self.conditional_disagg_threshold:
            text += f", < {self.conditional_disagg_threshold} local"
        if self.local_prefill_max_uncached_tokens and not self.colocated:
            text += f", <= {self.local_prefill_max_uncached_tokens} uncached local"
        return text

    @property
    def label(self) -> str:
        return (
            f"{self.placement}; chunk {self.max_num_batched_tokens}, seqs {self.max_num_seqs}, "
            f"watermark {self.admission_watermark:g}"
        )

    def with_(self, **changes: Any) -> Deployment:
        return replace(self, **changes)

    def engine_settings(self) -> dict[str, Any]:
        """The searched engine settings, the same on every node."""
        return {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
        }

    def role_settings(self) -> dict[str, Any]:
        """The tensor-parallel sizes by role, as `pdserve serve --config` reads them (none where
        every node is one device)."""
        if self.prefill_tp == self.decode_tp == 1:
            return {}
        sizes = {"decode_tensor_parallel_size": self.decode_tp}
        if not self.colocated:
            sizes["prefill_tensor_parallel_size"] = self.prefill_tp
        return sizes

    def coordinator_settings(self) -> dict[str, Any]:
        threshold = self.conditional_disagg_threshold
        return {
            "admission_watermark": self.admission_watermark,
            # Backpressure scaled with the deployment, so that a large one is not capped by the
            # default's 512 requests in flight before decoding.
            "max_pending_requests": max(512, 64 * self.nodes),
            # Nothing goes to a prefill node when there is none; the cluster file writes
            # colocated workers as decode nodes, which need this to take whole requests.
            "conditional_disagg_threshold": ALL_LOCAL if self.colocated else threshold,
            "local_prefill_max_uncached_tokens": self.local_prefill_max_uncached_tokens,
        }
