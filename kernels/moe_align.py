"""The routed (token, slot) pairs of a mixture-of-experts layer sorted by expert and padded into
row blocks of one expert each: the schedule of the fused MoE kernel's grouped GEMM.

Built from torch ops on the device, sized by shapes alone (no host sync, no data-dependent
shapes), so the whole MoE layer can be captured in a CUDA graph and replayed with new routes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """Pair p = token * k + slot. Rows [i * block_m, (i + 1) * block_m) of `sorted_pair_ids` are
    pairs routed to expert `block_expert[i]`, in their original order, padded with the sentinel
    `num_pairs`; blocks from `num_padded` rows on are unused (expert -1)."""

    sorted_pair_ids: torch.Tensor  # [max_padded] int32
    block_expert: torch.Tensor  # [max_padded // block_m] int32
    num_padded: torch.Tensor  # [1] int64: rows in used blocks
    num_pairs: int  # the sentinel
    block_m: int

    @property
    def num_used_blocks(self) -> torch.Tensor:
        return self.num_padded // self.block_m


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the padded schedule can need: each expert that receives a pair (at most
    min(E, pairs) of them) pads its group by fewer than block_m rows."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_pairs_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Schedules topk_ids [T, k] (expert ids in [0, num_experts)) into block_m-row blocks."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_experts, order = torch.sort(flat, stable=True)
    # Expert e's pairs are sorted_experts[bounds[e] : bounds[e + 1]].
    experts = torch.arange(num_experts + 1, device=device, dtype=flat.dtype)
    bounds = torch.searchsorted(sorted_experts, experts)
    counts = bounds[1:] - bounds[:-1]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    padded_start = padded_end - padded_counts
    # The i-th sorted pair of expert e lands on row padded_start[e] + (i - bounds[e]).
    shift = padded_start - bounds[:-1]
    rows = torch.arange(num_pairs, device=device) + shift[sorted_experts]
    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, rows, order.to(torch.int32))
    # A block's expert is the first whose padded group ends after the block's first row; empty
    # experts end where their predecessor does, so they are never chosen.
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    num_padded = padded_end[-1:]
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_starts < num_padded, block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_pair_ids, block_expert, num_padded, num_pairs, block_m)
