"""Torch reference for a mixture-of-experts MLP: group the routed (token, expert) pairs by expert,
run each expert's gated MLP on its tokens, and sum each token's expert outputs scaled by their
routing weights. The ground truth the fused Triton kernel (`pdserve.kernels.triton_moe`) is
tested against; what CPU nodes run.

Expert weights are stacked: `w13[e]` holds expert e's gate projection (rows 0..I) above its up
projection (rows I..2I), `w2[e]` its down projection, as a tensor-parallel rank holds its columns
of every expert. `grouped_experts` is the routing and combining alone, around any expert MLP (a
CPU node's runs on weights packed for oneDNN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

# expert_mlp(e, x): expert e's gated MLP on the rows x routed to it
ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]


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
    width = w13.shape[1] // 2

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, w13[expert]).split(width, dim=-1)
        return F.linear(F.silu(gate) * up, w2[expert])

    return grouped_experts(hidden, topk_weights, topk_ids, w13.shape[0], w2.shape[1], expert_mlp)


def grouped_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    out_features: int,
    expert_mlp: ExpertMLP,
) -> torch.Tensor:
    """The routing and combining around `expert_mlp`: each expert runs once, on its tokens."""
    num_tokens, k = topk_ids.shape
    out = torch.zeros(num_tokens, out_features, dtype=torch.float32, device=hidden.device)
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
        y = expert_mlp(expert, hidden[tokens])
        out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
    return out.to(hidden.dtype)
