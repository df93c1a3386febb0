"""The router of a mixture-of-experts layer: which k experts each token goes to, and with what
weights. Softmax over the router's logits in float32, the k largest probabilities, renormalised
to sum to one where the family does so (Mixtral always; Qwen2-MoE and Qwen3-MoE as their config's
`norm_topk_prob` says).

Ties are broken as `torch.topk` breaks them, which is not always toward the lower index (on CPU,
of [1, 1, 1, 0] it picks experts 1 and 2): that is what transformers' routers call too, so a
tie routes here as it routes there."""

from __future__ import annotations

import torch


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), highest weight first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
