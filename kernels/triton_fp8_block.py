"""Triton GEMMs of activations with block-scaled FP8 weights (DeepSeek-V3's layout: float8_e4m3fn
[N, K], one float32 `weight_scale_inv` per (bn, bk) block), in two variants of one kernel:

- FP8 (`fp8_block_matmul`, capability >= 8.9): each token's K group of bk is quantized to e4m3
  in registers (scale amax / 448, as DeepSeek's `act_quant`), multiplied on FP8 tensor cores,
  and the partial product of each K block scaled by both scales, in float32;
- W8A16 (`w8a16_block_matmul`, any GPU): the weight bytes are decoded to the activations' dtype
  (exactly) and multiplied with the activations as they are; the weight scale applies per block.

The reduction steps one bk block at a time; ragged last blocks in N and K are masked. Each output
row's scale row comes from `scale_rows`, so fused projections whose parts end in ragged blocks
(each part keeping its own scale rows) run as one GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_e4m3 import e4m3_to_float32, round_to_e4m3
from pdserve.kernels.triton_w4a16 import GemmTiles, dot_options

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _fp8_block_kernel(
    x_ptr,
    weight_ptr,
    scale_ptr,
    scale_rows_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    stride_om,
    FP8_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block): out[rows, cols] = sum over K blocks kb of
    (x[rows, kb] @ w[cols, kb]^T) * scale[cols' scale row, kb], the weight read as its bytes;
    with FP8_DOT x is quantized per row and block first and its scale applied too."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    scale_rows = tl.load(scale_rows_ptr + cols, mask=col_mask, other=0).to(tl.int64)
    s_ptrs = scale_ptr + scale_rows * stride_sn
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_ptrs = weight_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptrs + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w_bytes = tl.load(w_ptrs + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
        w_scale = tl.load(s_ptrs + k0 // BLOCK_K, mask=col_mask, other=0.0)
        if FP8_DOT:
            xf = x.to(tl.float32)
            amax = tl.max(tl.abs(xf), axis=1)
            x_scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
            xq = tl.math.div_rn(xf, x_scale[:, None])
            xq = round_to_e4m3(tl.minimum(tl.maximum(xq, -FP8_MAX), FP8_MAX))
            part = tl.dot(xq.to(tl.float8e4nv), w_bytes.to(tl.float8e4nv, bitcast=True))
            acc += part * x_scale[:, None] * w_scale[None, :]
        else:
            w = e4m3_to_float32(w_bytes).to(x_ptr.dtype.element_ty)  # exact in 16 bits
            if UPCAST_DOT:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * w_scale[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# Not yet timed on a GPU. The reduction step is the weight's bk (128 for DeepSeek-V3 and
# Qwen3-FP8), so these choose rows and columns only; 128x128 tiles spill registers on sm_90
# (the activation tile is quantized, or the weight tile decoded, in registers).
def fp8_block_tiles(m: int, dtype: torch.dtype) -> GemmTiles:
    if dtype == torch.float32:
        return GemmTiles(16, 32, 0, num_warps=4, num_stages=2)
    if m <= 16:
        return GemmTiles(16, 64, 0, num_warps=4, num_stages=4)
    if m <= 64:
        return GemmTiles(32, 64, 0, num_warps=4, num_stages=3)
    return GemmTiles(64, 128, 0, num_warps=8, num_stages=3)


def default_scale_rows(n: int, block_n: int, device: torch.device) -> torch.Tensor:
    """Each output row's scale row for an unfused weight: row // bn."""
    return torch.arange(n, device=device, dtype=torch.int32) // block_n


def _launch(
    fp8_dot: bool,
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    scale_rows: torch.Tensor | None,
    tiles: GemmTiles | None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block
    if bk < 16 or bk > 256 or bk & (bk - 1):
        raise ValueError(
            f"weight_block_size {list(block)}: the kernels need a K block that is a power of two "
            "from 16 to 256"
        )
    if weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k:
        raise ValueError(
            f"weight must be float8_e4m3fn [N, {k}], got {weight.dtype} {tuple(weight.shape)}"
        )
    expected = (-(-n // bn), -(-k // bk)) if scale_rows is None else None
    if expected and tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv must be {list(expected)} for a weight of {[n, k]} in blocks of "
            f"{list(block)}, got {list(weight_scale_inv.shape)}"
        )
    if scale_rows is None:
        scale_rows = default_scale_rows(n, bn, x.device)
    tiles = tiles or fp8_block_tiles(m, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    # The kernel steps along K with unit stride (no copy when they are, as layers keep them).
    weight_bytes = weight.contiguous().view(torch.uint8)
    weight_scale_inv = weight_scale_inv.contiguous()
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _fp8_block_kernel[grid](
        x,
        weight_bytes,
        weight_scale_inv,
        scale_rows,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight_bytes.stride(0),
        weight_scale_inv.stride(0),
        out.stride(0),
        FP8_DOT=fp8_dot,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=bk,
        **dot_options(x.device, x.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def fp8_block_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    scale_rows: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized weight^T with the activations quantized to FP8 per token and K
    block (`fp8_block_ref.fp8_block_matmul_ref`): FP8 tensor-core dots, capability >= 8.9.
    weight float8_e4m3fn [N, K]; weight_scale_inv float32 [ceil(N / bn), ceil(K / bk)] (any
    rows when `scale_rows`, int [N], names each output row's). Returns [M, N] in x's dtype."""
    return _launch(True, x, weight, weight_scale_inv, block, scale_rows, tiles)


def w8a16_block_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    scale_rows: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """As `fp8_block_matmul` without quantizing the activations: the weight decoded in-kernel to
    x's dtype, for GPUs without FP8 dots. Equals `fp8_block_matmul_ref(..., quantize_x=False)`."""
    return _launch(False, x, weight, weight_scale_inv, block, scale_rows, tiles)
