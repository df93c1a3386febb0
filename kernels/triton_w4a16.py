"""Triton GEMM of activations with 4-bit group-quantized weights (W4A16): y = x @ ((q - z) * s)^T,
the weight read packed (a quarter of bf16's bytes), dequantized in registers tile by tile, and
multiplied on the tensor cores in the activations' dtype with float32 accumulation.

The layout is `w4a16_ref`'s: compressed-tensors' `pack-quantized`; AWQ and GPTQ layers repack to
it when they load. One tile table serves decode (M of 1 to 16) and prefill (thousands of rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.w4a16_ref import SYMMETRIC_ZERO

PACK = 8  # 4-bit values per int32 word
_SYMMETRIC_ZERO = tl.constexpr(float(SYMMETRIC_ZERO))


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    group_size,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block): out[rows, cols] = x[rows] @ weight[cols]^T, each
    BLOCK_K step inside one quantization group (one scale and zero point per column)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    words_per_row = tl.cdiv(K, 8)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_ptrs = qweight_ptr + cols.to(tl.int64)[None, :] * stride_qn
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptrs + ks[None, :] * stride_xk,
            mask=row_mask[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        # BLOCK_K / 8 words of each column, unpacked to [BLOCK_K, BLOCK_N], k = 8 * word + j.
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(
            q_ptrs + words[:, None], mask=(words < words_per_row)[:, None] & col_mask[None, :]
        )
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
        group = k0 // group_size
        s = tl.load(scales_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + cols * stride_zn + group, mask=col_mask, other=0).to(tl.float32)
            w = (q - z[None, :]) * s.to(tl.float32)[None, :]
        else:
            w = (q - _SYMMETRIC_ZERO) * s.to(tl.float32)[None, :]
        w = w.to(x_ptr.dtype.element_ty)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """Tile sizes and launch options of a quantized GEMM."""

    block_m: int  # activation rows per program
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


# Not yet timed on a GPU: decode tiles keep many programs over N (a 4096-wide weight gives 128
# at BLOCK_N 32) and a long K step; prefill tiles are the usual 128x128 of a bf16 GEMM.
# float32 (tests, debugging) uses exact FMA dots, which need more registers: narrower tiles.
def w4a16_tiles(m: int, dtype: torch.dtype) -> GemmTiles:
    if dtype == torch.float32:
        return GemmTiles(16, 32, 64, num_warps=4, num_stages=2)
    if m <= 16:
        return GemmTiles(16, 32, 128, num_warps=4, num_stages=4)
    if m <= 64:
        return GemmTiles(32, 64, 128, num_warps=4, num_stages=3)
    return GemmTiles(128, 128, 64, num_warps=8, num_stages=3)


def group_block_k(block_k: int, group_size: int, in_features: int) -> int:
    """The reduction step: at most `block_k`, and each step inside one group (a power of two
    that divides the group size, or any step when one group spans the whole row)."""
    if group_size >= in_features:
        return block_k
    step = min(block_k, group_size & -group_size)  # the largest power of two dividing it
    if step < 16:
        raise ValueError(
            f"group_size {group_size} is not a multiple of 16: the W4A16 kernel steps through "
            "K in powers of two of at least 16 inside one group"
        )
    return step


def dot_options(device: torch.device, dtype: torch.dtype) -> dict:
    """Off-GPU the kernels run in Triton's interpreter, whose tl.dot multiplies bfloat16 as raw
    bits: there the operands go up to float32. float32 dots must not use TF32 tensor cores."""
    upcast = device.type != "cuda"
    exact = upcast or dtype == torch.float32
    return {"DOT_PRECISION": "ieee" if exact else None, "UPCAST_DOT": upcast}


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32); qweight int32 [N, ceil(K / 8)]; scales
    [N, ceil(K / group_size)] (x's dtype or float16); zeros like scales (unsigned integers) or
    None (symmetric: zero point 8). Returns x @ ((q - z) * s)^T, [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    groups = -(-k // group_size)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (n, -(-k // PACK)):
        raise ValueError(
            f"qweight must be int32 [N, {-(-k // PACK)}] for K={k}, got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    if tuple(scales.shape) != (n, groups):
        raise ValueError(
            f"scales must be [{n}, {groups}] for group_size {group_size}, got {tuple(scales.shape)}"
        )
    if zeros is not None and tuple(zeros.shape) != (n, groups):
        raise ValueError(f"zeros must be [{n}, {groups}] like scales, got {tuple(zeros.shape)}")
    tiles = tiles or w4a16_tiles(m, x.dtype)
    block_k = group_block_k(tiles.block_k, group_size, k)
    # The kernel steps along K with unit stride (no copy when they are, as layers keep them).
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _w4a16_kernel[grid](
        x,
        qweight,
        scales,
        scales if zeros is None else zeros,  # never read without zeros
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        scales.stride(0),
        scales.stride(0) if zeros is None else zeros.stride(0),
        out.stride(0),
        group_size,
        HAS_ZEROS=zeros is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        **dot_options(x.device, x.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
