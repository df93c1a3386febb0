"""One candidate deployment: how many prefill and decode nodes (or colocated workers), and the
settings the tuner searches, as the coordinator config and engine settings pdserve reads."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from coordinator.config import CoordinatorConfig
from engine.config import EngineConfig

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

    def __post_init__(self) -> None:
        if self.colocated and self.prefill:
            raise ValueError("a colocated deployment has no prefill nodes")
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
    def placement(self) -> str:
        if self.colocated:
            return f"{self.decode} colocated"
        text = f"{self.prefill}P + {self.decode}D"
        if self.conditional_disagg_threshold:
            text += f", < {self.conditional_disagg_threshold} local"
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
        }
