"""Triton rotary embedding (rotate-half form) applied in place to q and k, matching `rotary_ref`.

One program per token rotates all its q heads and k heads with one read of its cos/sin row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, half, cos, sin, dims, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)
    ptr1 = x_ptr + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # The reference multiplies and adds in the tensor's own dtype; rounding where it rounds makes
    # a half-precision result the reference's bit for bit (for float32 the casts are no-ops).
    c = cos.to(dtype).to(tl.float32)
    s = sin.to(dtype).to(tl.float32)
    out1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    out2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(ptr1, out1.to(dtype), mask=mask)
    tl.store(ptr1 + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + dims, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, half, cos, sin, dims, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, half, cos, sin, dims, BLOCK_HK)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, Hkv, D] in place (strided views of a fused qkv are fine) and
    returns them; a tensor whose last dim is not contiguous is rotated in a copy, returned instead.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return q, k
    half = cos_sin_cache.shape[1] // 2
    if q.shape[-1] != 2 * half or k.shape[-1] != 2 * half:
        raise ValueError(f"head_dim {q.shape[-1]} does not match the rotary table's {2 * half}")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        q.shape[1],
        k.shape[1],
        half,
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        # Else the compiler fuses a product and the following sum into one FMA, eliding the
        # product's rounding: on an H200, a third of the half-precision outputs differed from the
        # reference by a unit in the last place.
        enable_fp_fusion=False,
    )
    return q, k
