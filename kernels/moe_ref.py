"""Torch reference for a mixture-of-experts MLP: group the routed (token, expert) pairs by expert,
run each expert's gated MLP on its tokens, and sum each token's expert outputs scaled by their
routing weights. The ground truth the fused Triton kernel (`pdserve.kernels.triton_moe`) is
tested against; what CPU nodes run.

Expert weights are stacked: `w13[e]` holds expert e's gate projection (rows 0..I) above its up
projection (rows I..2I), `w2[e]` its down projection, as a tensor-parallel rank holds its columns
of every expert.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k] (float32) and topk_ids
    [T, k] from the router. Returns [T, H] in hidden's dtype: for each token the sum over its k
    experts of weight * down(silu(gate(x)) * up(x)), accumulated in float32."""
    num_tokens, k = topk_ids.shape
    num_experts, two_i, _ = w13.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1).float()
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // k
        gate, up = F.linear(hidden[tokens], w13[expert]).split(two_i // 2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
    return out.to(hidden.dtype)
