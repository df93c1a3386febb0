"""The canonical 4-bit weight layout the W4A16 GEMM reads (compressed-tensors' `pack-quantized`),
in plain torch: packing, unpacking, dequantization and the float32 matmul that is the ground
truth for `triton_w4a16.w4a16_matmul`.

qweight int32 [N, ceil(K / 8)]: eight unsigned 4-bit values per word along K, the lowest bits
first; scales [N, ceil(K / G)]; zeros [N, ceil(K / G)] unsigned integers, or None for the
symmetric form, whose zero point is 8. The weight is (q - z) * s, [N, K].
"""

from __future__ import annotations

import torch

SYMMETRIC_ZERO = 8  # a symmetric 4-bit checkpoint stores q = w / s + 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int32 [N, ceil(K / 8)] of unsigned 4-bit values q [N, K] (0..15), eight a word along K,
    the lowest bits first; a ragged last word is padded with zeros."""
    if q.min() < 0 or q.max() > 15:
        raise ValueError("4-bit values must lie in 0..15")
    rows, cols = q.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int64, device=q.device)
    padded[:, :cols] = q.to(torch.int64)
    shifts = torch.arange(8, dtype=torch.int64, device=q.device) * 4
    words = (padded.view(rows, -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, K] of the 4-bit values packed in qweight [N, ceil(K / 8)]."""
    shifts = torch.arange(8, dtype=torch.int32, device=qweight.device) * 4
    values = (qweight[:, :, None] >> shifts) & 0xF
    return values.reshape(qweight.shape[0], -1)[:, :in_features]


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """float32 [N, K]: each 4-bit value minus its group's zero point, times its group's scale."""
    q = unpack_int4(qweight, in_features).float()
    groups = torch.arange(in_features, device=qweight.device) // group_size
    z = SYMMETRIC_ZERO if zeros is None else zeros.float()[:, groups]
    return (q - z) * scales.float()[:, groups]


def w4a16_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ dequantized weight^T, in float32, returned in x's dtype."""
    weight = dequantize(qweight, scales, zeros, group_size, x.shape[1])
    return (x.float() @ weight.T).to(x.dtype)
