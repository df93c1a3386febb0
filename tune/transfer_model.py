"""The time of one KV handoff, the simulator's stand-in for a transport: a fixed latency per
transfer plus its bytes over the sender's bandwidth. A prefill node's sends share its link one
after another; a receiver takes whatever arrives."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TransferModel:
    latency_s: float  # per transfer: handshakes, acks, thread hand-offs
    bytes_per_s: float  # the sender's link, one transfer at a time
    transport: str = "tcp"

    def wire_time(self, num_bytes: int) -> float:
        """How long the transfer occupies the sender's link."""
        return num_bytes / self.bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransferModel:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def fit(cls, sizes: list[int], seconds: list[float], transport: str) -> TransferModel:
        """Least squares of seconds = latency + bytes / bandwidth over measured transfers, in
        relative error; both terms kept positive."""
        x = np.asarray(sizes, dtype=float)
        y = np.asarray(seconds, dtype=float)
        a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
        latency, per_byte = np.linalg.lstsq(a, np.ones_like(y), rcond=None)[0]
        if per_byte <= 0:  # sizes too alike to tell: the fastest rate seen, no latency
            return cls(0.0, float(np.max(x / y)), transport)
        return cls(max(0.0, float(latency)), 1.0 / float(per_byte), transport)
