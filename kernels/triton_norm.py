"""Triton RMSNorm and fused residual-add + RMSNorm, matching `norm_ref` (Hugging Face's math).

One program per row; statistics in float32, then the same two roundings as the reference
(normalized value to the input dtype, then weight * it), so bfloat16 results match it closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    inner,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Rows are addressed as (outer, inner) so [T, H, D] views of a fused qkv need no copy.
    outer_i = row // inner
    inner_i = row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer_i * stride_x0 + inner_i * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + outer_i * stride_r0 + inner_i * stride_r1 + cols, mask=mask, other=0.0
        )
        summed = (x.to(tl.float32) + r.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * n_cols + cols, summed, mask=mask)
        h = summed.to(tl.float32)
        in_dtype = summed_ptr.dtype.element_ty
    else:
        h = x.to(tl.float32)
        in_dtype = x_ptr.dtype.element_ty
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(in_dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 3-d [outer, inner, cols] tensor with unit last stride (a view where possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, in_dtype), device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=in_dtype, device=x.device)
    n_cols = x.shape[-1]
    if x.numel() == 0:
        return out, summed
    x3 = _as_rows(x)
    r3 = x3 if residual is None else _as_rows(residual.expand_as(x))
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3,
        r3,
        weight,
        out,
        out if summed is None else summed,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; the inputs are untouched."""
    out, summed = _launch(x, residual, weight, eps)
    return out, summed
