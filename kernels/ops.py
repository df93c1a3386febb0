"""The op table the engine calls: one name per op, the backend chosen once at start-up.

`torch` (the reference, CPU and debugging) is always available; `triton` kernels, when present,
register themselves for CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels import attention_ref, norm_ref, rotary_ref


@dataclass(frozen=True, slots=True)
class Ops:
    name: str
    store_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary: Callable


REFERENCE = Ops(
    name="torch",
    store_kv=attention_ref.store_kv,
    paged_attention=attention_ref.paged_attention,
    rms_norm=norm_ref.rms_norm,
    fused_add_rms_norm=norm_ref.fused_add_rms_norm,
    apply_rotary=rotary_ref.apply_rotary,
)


def select_ops(device: str, backend: str = "auto") -> Ops:
    """`auto`: Triton on CUDA when importable, the torch reference otherwise."""
    if backend == "torch" or (backend == "auto" and not device.startswith("cuda")):
        return REFERENCE
    try:
        from kernels.triton_ops import TRITON
    except ImportError as exc:
        if backend == "triton":
            raise RuntimeError(f"kernel backend 'triton' is unavailable: {exc}") from exc
        return REFERENCE
    return TRITON
