"""Rotary position embedding on CPU without concatenations: each half of a head written in place
as x1·cos − x2·sin and x2·cos + x1·sin. The reference (rotary_ref) builds cos, sin and the rotated
half with torch.cat, four copies a call that on CPU cost as much as the arithmetic; the products
and sums here are the same ones in the same order, so the results are identical."""

from __future__ import annotations

import torch


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `rotary_ref.apply_rotary`: q [T, H, D], k [T, Hkv, D], positions [T], cos_sin_cache
    [max_pos, D] (cos | sin halves of D/2, float32)."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        first, second = out[..., :half], out[..., half:]
        torch.mul(x1, c, out=first)
        first.add_(-x2 * s)  # x1·cos + (−x2)·sin, as the reference sums it
        torch.mul(x2, c, out=second)
        second.add_(x1 * s)
        return out

    return rotate(q), rotate(k)
