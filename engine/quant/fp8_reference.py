"""The published layout of block-scaled FP8 weights, both ways, in plain torch: dequantization
(the ground truth every faster path is tested against) and quantization (how tests and
benchmarks write such checkpoints from float weights)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of `weight_scale_inv` for a weight of `shape`: one scale per block, the last
    block of each dimension possibly ragged."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 [out, in]: each element of the FP8 `weight` times its block's `scale_inv`."""
    rows, cols = weight.shape
    if tuple(scale_inv.shape) != scale_shape((rows, cols), block):
        raise ValueError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight of "
            f"{(rows, cols)} in blocks of {block}: expected {scale_shape((rows, cols), block)}"
        )
    expanded = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    expanded = expanded.repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * expanded


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) of a float weight [out, in]: each
    block's largest magnitude maps to FP8's largest (448), as DeepSeek's and transformers'
    quantizers do."""
    rows, cols = weight.shape
    srows, scols = scale_shape((rows, cols), block)
    padded = torch.zeros(srows * block[0], scols * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(srows, block[0], scols, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = blocks / scale_inv[:, None, :, None]
    quantized = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(srows * block[0], -1)
    return quantized[:rows, :cols].contiguous(), scale_inv
