"""The router of a mixture-of-experts layer: which k experts each token goes to, and with what
weights.

Mixtral, Qwen2-MoE and Qwen3-MoE (`route`): softmax over the router's logits in float32, the k
largest probabilities, renormalised to sum to one where the family does so (Mixtral always;
Qwen2-MoE and Qwen3-MoE as their config's `norm_topk_prob` says).

gpt-oss (`route_top_logits`): the k largest logits (its router has a bias), softmaxed among
themselves.

DeepSeek (`route_grouped`): the experts fall in `n_group` equal groups and a token may only use
the `topk_group` best groups. V2 scores with softmax and ranks a group by its best score; V3
scores with sigmoid, adds `e_score_correction_bias` to the scores for choosing (only), and ranks
a group by the sum of its two best corrected scores; V3's k weights are its uncorrected scores,
renormalised per `norm_topk_prob`. Both scale the weights by `routed_scaling_factor`.

Ties are broken as `torch.topk` breaks them, which is not always toward the lower index (on CPU,
of [1, 1, 1, 0] it picks experts 1 and 2): that is what transformers' routers call too, so a
tie routes here as it routes there (DeepSeek's with `sorted=False`, as transformers' do)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.models.config import ModelConfig


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), highest weight first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), highest weight first:
    a softmax over each token's k largest logits only."""
    top, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


@dataclass(frozen=True, slots=True)
class GroupedRouting:
    """DeepSeek's routing policy, read from its config."""

    top_k: int
    renormalize: bool
    scoring: str  # "softmax" (V2) | "sigmoid" (V3)
    n_group: int
    topk_group: int
    scaling: float

    @classmethod
    def of(cls, cfg: ModelConfig) -> GroupedRouting:
        return cls(
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.scoring_func,
            cfg.n_group,
            cfg.topk_group,
            cfg.routed_scaling_factor,
        )


def route_grouped(
    logits: torch.Tensor, policy: GroupedRouting, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), in no set order.
    correction_bias [E] (float32): V3's, added to the scores for choosing only."""
    num_tokens, num_experts = logits.shape
    per_group = num_experts // policy.n_group
    if policy.scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
        choice = scores if correction_bias is None else scores + correction_bias
        grouped = choice.view(num_tokens, policy.n_group, per_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        excluded = float("-inf")
    else:
        scores = choice = torch.softmax(logits.float(), dim=-1)
        group_scores = choice.view(num_tokens, policy.n_group, per_group).max(dim=-1).values
        excluded = 0.0
    if policy.topk_group < policy.n_group:
        groups = torch.topk(group_scores, policy.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, excluded)
    ids = torch.topk(choice, policy.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if policy.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * policy.scaling, ids
