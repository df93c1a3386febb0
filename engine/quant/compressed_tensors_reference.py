"""The published layouts of compressed-tensors weights (what llm-compressor writes), both ways, in
plain torch: dequantization (the ground truth every faster path is tested against) and
quantization (how tests and benchmarks write such checkpoints from float weights).

- `float-quantized`: `weight` float8_e4m3fn [out, in], `weight_scale` [1] (tensor) or [out, 1]
  (channel).
- `int-quantized`: `weight` int8 [out, in], `weight_scale` [out, 1] (channel), symmetric.
- `pack-quantized` (4-bit): `weight_packed` int32 [out, ceil(in / 8)], eight values a word, the
  first in the lowest bits, each stored plus 8 (so -8..7 become 0..15); `weight_scale`
  [out, in / group_size] (group) or [out, 1] (channel); `weight_zero_point` (asymmetric only)
  packed the same way but along the OUTPUT rows, int32 [ceil(out / 8), groups]; `weight_shape`
  [2] = (out, in).

A weight is (q - zero_point) * scale, in the scale's group of input columns (compressed-tensors'
`_dequantize`), with q and the zero point in -8..7 for 4 bits, -128..127 for int8.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT4_OFFSET = 8  # a stored 4-bit value is the signed one plus 8
PER_WORD = 8  # 4-bit values per int32


def pack_int4(values: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """int32 words of signed 4-bit `values` (int8 in -8..7, 2-D) packed along `dim`: eight a
    word, the first in the lowest four bits, each stored plus 8; a ragged last word is padded
    with zeros (compressed-tensors' `pack_to_int32(values, 4, packed_dim=dim)`)."""
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(f"pack_int4 takes a 2-D int8 tensor, not {values.dtype} {values.dim()}-D")
    if values.min() < -INT4_OFFSET or values.max() >= INT4_OFFSET:
        raise ValueError("pack_int4 takes values in -8..7")
    nibbles = (values.to(torch.int64) + INT4_OFFSET).movedim(dim, -1)
    count = nibbles.shape[-1]
    padded = -(-count // PER_WORD) * PER_WORD
    nibbles = torch.nn.functional.pad(nibbles, (0, padded - count))
    shifts = 4 * torch.arange(PER_WORD, dtype=torch.int64)
    words = (nibbles.view(*nibbles.shape[:-1], -1, PER_WORD) << shifts).sum(-1)
    # Words whose top nibble is 8 or more are negative int32s: wrap them as the bits say.
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int4(words: torch.Tensor, count: int, dim: int = 1) -> torch.Tensor:
    """The signed 4-bit values (int8 in -8..7) of int32 `words` packed along `dim`, the first
    `count` of that dimension (the inverse of `pack_int4`)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed 4-bit words are int32, not {words.dtype}")
    moved = words.movedim(dim, -1).to(torch.int64)
    shifts = 4 * torch.arange(PER_WORD, dtype=torch.int64)
    nibbles = (moved[..., None] >> shifts) & 0xF
    nibbles = nibbles.flatten(-2)[..., :count]
    return (nibbles - INT4_OFFSET).to(torch.int8).movedim(-1, dim).contiguous()


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [out, in]: (q - zero_point) * scale, each scale (and zero point) covering its
    group of in / groups input columns; `scale` is [out, groups], [out, 1] (one per row) or [1]
    or a scalar (one for the tensor); q int8 or float8_e4m3fn."""
    rows, cols = q.shape
    scale = scale.float().reshape(-1, scale.shape[-1] if scale.dim() == 2 else 1)
    if scale.shape[0] == 1:
        scale = scale.expand(rows, -1)
    groups = scale.shape[1]
    if scale.shape[0] != rows or cols % groups:
        raise ValueError(
            f"weight_scale of shape {tuple(scale.shape)} for a weight of {(rows, cols)}: expected "
            f"[{rows}, groups] with groups dividing {cols}"
        )
    values = q.float()
    if zero_point is not None:
        values = values.view(rows, groups, -1) - zero_point.float().view(rows, groups, 1)
    return (values.view(rows, groups, -1) * scale[:, :, None]).view(rows, cols)


# --- quantization (writing checkpoints) ---------------------------------------------------------


def quantize_int(
    weight: torch.Tensor, num_bits: int, group_size: int | None, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q int8 [out, in], float32 weight_scale [out, groups], int8 zero point [out, groups] or
    None) of a float weight: min-max per group of `group_size` input columns (None: per row), as
    llm-compressor's minmax observer does (the range always holds zero)."""
    rows, cols = weight.shape
    size = group_size or cols
    if cols % size:
        raise ValueError(f"{cols} input columns are not whole groups of {size}")
    q_min, q_max = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    grouped = weight.float().view(rows, cols // size, size)
    low = grouped.amin(-1).clamp(max=0)
    high = grouped.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(low.abs(), high) / ((q_max - q_min) / 2)
        zero = torch.zeros_like(scale)
    else:
        scale = (high - low) / (q_max - q_min)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not symmetric:
        zero = (q_min - torch.round(low / scale)).clamp(q_min, q_max)
    q = torch.round(grouped / scale[..., None] + zero[..., None]).clamp(q_min, q_max)
    zero_point = None if symmetric else zero.to(torch.int8)
    return q.to(torch.int8).view(rows, cols), scale, zero_point


def quantize_fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale [out, 1] or [1]) of a float weight: each
    row's (or the tensor's) largest magnitude maps to FP8's largest (448)."""
    weight = weight.float()
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().view(1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    divisor = scale if per_channel else scale.view(1, 1)
    return (weight / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
