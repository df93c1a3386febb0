"""How the fused MoE kernels (`triton_moe`, `triton_moe_small`) ask Triton for their dots: exact
where they must be, upcast where Triton's interpreter runs them."""

from __future__ import annotations

import torch


def dot_options(device: torch.device, dtype: torch.dtype) -> dict:
    """The DOT_PRECISION and UPCAST_DOT kernel arguments for activations of `dtype` on `device`."""
    # Off-GPU the kernels run in Triton's interpreter, whose tl.dot multiplies bfloat16 as its raw
    # uint16 bits: there the operands go up to float32, which holds them exactly. float32 dots
    # must not use TF32 tensor cores (they would lose ~1e-3).
    upcast = device.type != "cuda"
    exact = upcast or dtype == torch.float32
    return {"DOT_PRECISION": "ieee" if exact else None, "UPCAST_DOT": upcast}
