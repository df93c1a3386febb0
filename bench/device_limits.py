"""What a device can do at best, measured in the run that compares a benchmark with it (a
device-to-device copy's bytes per second, a square matmul's FLOPs per second), and the results
file of such a run, for `bench.kernels`, `bench.model_step` and `bench.moe` alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# How a benchmark times a call on the device: the milliseconds one call of fn takes.
Timer = Callable[[Callable[[], object]], float]


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    copy_gbps: float  # a large device-to-device copy: bytes read plus bytes written, GB/s
    matmul_tflops: float  # a square matmul in the run's dtype

    @classmethod
    def measure(
        cls, time_ms: Timer, device: str, dtype: torch.dtype, copy_bytes: int, matmul_n: int
    ) -> DeviceLimits:
        """Both limits, timed as the benchmark times its own work."""
        return cls(
            copy_gbps(time_ms, device, copy_bytes),
            matmul_tflops(time_ms, device, dtype, matmul_n),
        )

    def of_copy(self, gbps: float) -> float:
        return gbps / self.copy_gbps

    def of_matmul(self, tflops: float) -> float:
        return tflops / self.matmul_tflops


def copy_gbps(time_ms: Timer, device: str, num_bytes: int) -> float:
    """A device-to-device copy of num_bytes: bytes read plus bytes written per second, in GB/s."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def matmul_tflops(time_ms: Timer, device: str, dtype: torch.dtype, n: int) -> float:
    """An n x n by n x n matmul: TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


@dataclass(slots=True)
class Results:
    """A run's results file: the device, the command, what else names the run, the limits, and
    the decode and prefill rows (each benchmark's own dataclasses) measured against them."""

    device: str
    command: str
    limits: DeviceLimits
    decode: list[Any]
    prefill: list[Any]
    about: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "command": self.command,
            **self.about,
            **asdict(self.limits),
            "decode": [asdict(r) for r in self.decode],
            "prefill": [asdict(r) for r in self.prefill],
        }
