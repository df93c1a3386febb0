"""The published MXFP4 layout of gpt-oss's experts, both ways, in plain torch: dequantization
(the ground truth every faster path is tested against) and quantization (how tests and
benchmarks write such checkpoints from float weights).

A weight [..., out, in] is stored as `blocks` uint8 [..., out, in / 32, 16] and `scales` uint8
[..., out, in / 32]: each run of 32 input columns is one block of 32 FP4 (e2m1) values, two to a
byte, the low nibble holding the even column and the high nibble the odd one; a nibble's top
bit is the sign and its low three bits index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. The
block's scale is an E8M0 exponent biased by 127: the value is fp4 * 2 ** (scale - 127). This is
what transformers' `convert_moe_packed_tensors` and OpenAI's reference read.
"""

from __future__ import annotations

import torch

BLOCK = 32  # FP4 values sharing one scale
SCALE_BIAS = 127  # E8M0's exponent bias
# The 16 FP4 e2m1 codes' values: the top bit the sign, the low three an index into magnitudes.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)
# Each byte's two values (low nibble first): a table of 256 x 2, so unpacking is one lookup.
_BYTE_VALUES = torch.tensor(FP4_VALUES, dtype=torch.float32)[
    torch.stack([torch.arange(256) & 0x0F, torch.arange(256) >> 4], dim=1)
]


def block_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of `blocks` and `scales` for a weight of `shape` [..., out, in]."""
    *lead, cols = shape
    if cols % BLOCK:
        raise ValueError(f"an MXFP4 weight's input dimension ({cols}) is not a multiple of {BLOCK}")
    return (*lead, cols // BLOCK, BLOCK // 2), (*lead, cols // BLOCK)


def unpack(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., out, in / 32, 32] in `dtype`: each byte's two FP4 values, the low nibble's first."""
    table = _BYTE_VALUES.to(device=blocks.device, dtype=dtype)
    # One gather of a value pair per byte (int32 indices: half the traffic of int64's).
    values = table.index_select(0, blocks.reshape(-1).to(torch.int32))
    return values.view(*blocks.shape[:-1], BLOCK)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """float32: each E8M0 exponent's power of two, 2 ** (scale - 127)."""
    ones = torch.ones(scales.shape, dtype=torch.float32, device=scales.device)
    return torch.ldexp(ones, scales.to(torch.int32) - SCALE_BIAS)


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., out, in] in `dtype`: each FP4 value of `blocks` times its block's power of two.
    bfloat16 is computed in bfloat16, as fast again and exact (an FP4 value has two significant
    bits and a power of two from 2 ** -127 to 2 ** 127 is one of bfloat16's, as of float32's);
    other dtypes in float32, then cast."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks of shape {tuple(blocks.shape)} and scales of "
            f"{tuple(scales.shape)}: expected [..., out, groups, 16] and [..., out, groups]"
        )
    exact = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    values = unpack(blocks, exact)
    values.mul_(scale_values(scales).to(exact)[..., None])
    return values.flatten(-2).to(dtype)


def _fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes of float32 values already within [-6, 6]: the nearest value, a tie
    going to the even code (0, 1, 2 and 4 over 0.5, 1.5, 3 and 6), the sign in bit 3."""
    magnitude = x.abs()
    # Midpoints between neighbouring magnitudes; a tie rounds up where the upper code is even.
    midpoints = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, m in enumerate(midpoints):
        crossed = magnitude >= m if i % 2 else magnitude > m
        code += crossed.to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) uint8 of a float weight [..., out, in] (in a multiple of 32): each
    block's scale the smallest power of two that brings its largest magnitude within FP4's 6
    (triton_kernels' `downcast_to_mxfp`, which transformers quantizes with, rounds its scales up
    by default), each value the nearest FP4 value."""
    blocks_shape, scales_shape = block_shapes(tuple(weight.shape))
    grouped = weight.float().reshape(*scales_shape, BLOCK)
    amax = grouped.abs().amax(dim=-1)
    # Round amax / 6 up to a power of two by its float32 bits (an all-zero block: 2 ** -127).
    bits = (amax / 6.0).view(torch.int32)
    exponent = ((bits + 0x007FFFFF) & 0x7F800000) >> 23  # biased by 127, as E8M0 is
    exponent = exponent.clamp(0, 254)
    scales = exponent.to(torch.uint8)
    scaled = (grouped / scale_values(scales)[..., None]).clamp(-6.0, 6.0)
    codes = _fp4_codes(scaled).reshape(*scales_shape, BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.reshape(blocks_shape).contiguous(), scales
