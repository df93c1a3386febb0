"""The backends of the op table (`Ops`) the engine calls, one chosen once at start-up.

`torch` (the reference, debugging) is always available; `triton` kernels, when present, register
themselves for CUDA tensors; `cpu` is the reference with paged attention from a C kernel and rotary without copies.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.kernels import attention_ref, gated_delta_ref, mla_ref, moe_ref, norm_ref, rotary_ref
from pdserve.kernels.op_table import Ops

REFERENCE = Ops(
    name="torch",
    store_kv=attention_ref.store_kv,
    paged_attention=attention_ref.paged_attention,
    rms_norm=norm_ref.rms_norm,
    fused_add_rms_norm=norm_ref.fused_add_rms_norm,
    apply_rotary=rotary_ref.apply_rotary,
    fused_moe=moe_ref.fused_moe,
    store_latent=mla_ref.store_latent,
    latent_attention=mla_ref.latent_attention,
    gated_delta_step=gated_delta_ref.gated_delta_step,
)


def cpu_ops() -> Ops | None:
    """The reference with paged attention from the C kernel that reads KV pages in place; None
    where the kernel cannot be built."""
    from pdserve.kernels import paged_attention_cpu, rotary_cpu

    if not paged_attention_cpu.available():
        return None
    return replace(
        REFERENCE,
        name="cpu",
        paged_attention=paged_attention_cpu.paged_attention,
        apply_rotary=rotary_cpu.apply_rotary,
        latent_attention=mla_ref.latent_attention_via(paged_attention_cpu.paged_attention),
    )


def select_ops(device: str, backend: str = "auto") -> Ops:
    """`auto`: Triton on CUDA when importable, the C attention kernel on CPU when it builds, the
    torch reference otherwise."""
    if backend == "torch":
        return REFERENCE
    if not device.startswith("cuda"):
        if backend == "triton":
            raise RuntimeError("kernel backend 'triton' runs on CUDA devices only")
        ops = cpu_ops()
        if ops is None and backend == "cpu":
            raise RuntimeError("kernel backend 'cpu' is unavailable: its C kernel did not build")
        return ops or REFERENCE
    if backend == "cpu":
        raise RuntimeError("kernel backend 'cpu' runs on CPU devices only")
    try:
        from pdserve.kernels.triton_ops import TRITON
    except ImportError as exc:
        if backend == "triton":
            raise RuntimeError(f"kernel backend 'triton' is unavailable: {exc}") from exc
        return REFERENCE
    return TRITON
