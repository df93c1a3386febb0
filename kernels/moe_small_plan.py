"""The fused MoE's schedule for one to eight tokens, chosen by token count: split-K over the few
active experts, so that many programs stream their weights at once.

At decode a step routes a handful of tokens to at most tokens x top-k experts (8 of DeepSeek-V3's
256 at one token). The grouped GEMM (`triton_moe`) gives each active expert one program per
column block, each walking the whole reduction: too few programs to keep a GPU's memory busy.
Here each GEMM's reduction is also cut into slices, one program per (expert, column block, slice),
until the programs fill the SMs several times over; the slices' float32 partial sums are added in
a fixed order afterwards (no atomics, so the result does not depend on timing).

Pure arithmetic on shapes, importable without Triton: the choice replays in a CUDA graph (it
depends on shapes alone) and is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Token counts up to this run the split-K schedule; larger batches the grouped GEMM.
SMALL_BATCH_MAX_TOKENS = 8
# tl.dot needs at least 16 rows; at eight tokens an expert receives at most eight pairs.
SMALL_BLOCK_M = 16
# Programs wanted per SM: enough loads in flight to stream weights at copy speed.
PROGRAMS_PER_SM = 4
# An H100/H200's SM count, the plan off-GPU (tests, sm_90 compile checks).
DEFAULT_SM_COUNT = 132
# No more slices than this per GEMM: each adds a [rows, N] float32 partial to read back.
MAX_SPLITS = 16


@dataclass(frozen=True, slots=True)
class SplitK:
    """One GEMM's reduction of `size` cut into `splits` slices of `per_split` (a multiple of the
    tile's block_k; the last slice may be shorter)."""

    splits: int
    per_split: int


@dataclass(frozen=True, slots=True)
class SmallMoePlan:
    """Tiles and reduction slices of both small-batch MoE kernels."""

    block_n: int  # output columns per program
    block_k: int  # reduction step
    gate_up: SplitK  # over hidden_size
    down: SplitK  # over the expert width
    num_warps: int
    num_stages: int
    block_m: int = SMALL_BLOCK_M


def use_small_batch(num_tokens: int) -> bool:
    """Whether `num_tokens` tokens run the split-K schedule (one to eight)."""
    return 1 <= num_tokens <= SMALL_BATCH_MAX_TOKENS


def split_reduction(size: int, block_k: int, wanted: int) -> SplitK:
    """`size` cut into about `wanted` slices of whole block_k steps, at least one step each."""
    steps = -(-size // block_k)
    splits = max(1, min(wanted, steps, MAX_SPLITS))
    per_split = -(-steps // splits) * block_k
    return SplitK(-(-size // per_split), per_split)


def plan_small_moe(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    inter_size: int,
    dtype: torch.dtype,
    sm_count: int = DEFAULT_SM_COUNT,
) -> SmallMoePlan | None:
    """The split-K plan for `num_tokens` tokens, or None where the grouped GEMM runs instead.

    Active experts are counted as if no two of the tokens' choices coincide (min(E, T x k)): the
    plan depends on shapes alone. float32 (tests, debugging) uses exact FMA dots: narrower tiles.
    """
    if not use_small_batch(num_tokens):
        return None
    if dtype == torch.float32:
        block_n, block_k, num_warps, num_stages = 32, 32, 4, 2
    else:
        block_n, block_k, num_warps, num_stages = 64, 128, 4, 3
    active = min(num_experts, num_tokens * top_k)
    target = PROGRAMS_PER_SM * sm_count

    def wanted(columns: int) -> int:
        programs = active * -(-columns // block_n)
        return -(-target // programs)

    return SmallMoePlan(
        block_n=block_n,
        block_k=block_k,
        gate_up=split_reduction(hidden_size, block_k, wanted(inter_size)),
        down=split_reduction(inter_size, block_k, wanted(hidden_size)),
        num_warps=num_warps,
        num_stages=num_stages,
    )
