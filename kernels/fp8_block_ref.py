"""Block-scaled FP8 GEMMs as DeepSeek-V3 runs them, in plain torch and float32: the ground truth
for `triton_fp8_block` and `triton_moe_fp8`.

The weight is float8_e4m3fn [N, K] with one float32 `weight_scale_inv` per (bn, bk) block, the
last block of each dimension possibly ragged. The FP8 path also quantizes the activations, per
token and per K group of bk, to e4m3 with scale amax / 448 (DeepSeek's `act_quant`); the W8A16
path multiplies the activations as they are by the dequantized weight.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 [..., N, K]: each FP8 element times its block's scale (leading dims: experts)."""
    rows, cols = weight.shape[-2:]
    scales = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :]
    scales = scales.repeat_interleave(block[1], -1)[..., :cols]
    return weight.float() * scales


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]) of x [M, K]: each token's
    K groups scaled so their largest magnitude is 448 (an all-zero group keeps scale 1)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    blocks = padded.view(m, groups, group)
    amax = blocks.abs().amax(-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (blocks / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(m, -1)[:, :k], scales


def fp8_block_matmul_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    quantize_x: bool = True,
) -> torch.Tensor:
    """x [M, K] @ dequantized weight^T in float32, returned in x's dtype; with `quantize_x` the
    activations first go through `quantize_activations` (groups of bk), as the FP8 kernel's do."""
    if quantize_x:
        xq, scales = quantize_activations(x, block[1])
        xf = xq.float() * scales.repeat_interleave(block[1], 1)[:, : x.shape[1]]
    else:
        xf = x.float()
    return (xf @ dequantize_blocks(weight, weight_scale_inv, block).T).to(x.dtype)
