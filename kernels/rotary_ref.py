"""Torch reference for rotary position embedding (the non-interleaved "rotate half" form)."""

from __future__ import annotations

import torch


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], positions: [T], cos_sin_cache: [max_pos, D] (cos | sin halves
    each of D/2, float32). Returns rotated (q, k) in their dtypes."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)

    return rotate(q), rotate(k)
