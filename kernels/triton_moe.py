"""Triton fused mixture-of-experts MLP matching `moe_ref.fused_moe`: a grouped GEMM over the routed
(token, slot) pairs sorted by expert (`moe_align`), in two kernels.

The first gathers each block's token rows, multiplies them by its expert's gate and up projections
at once and writes silu(gate) * up; the second multiplies those by the expert's down projection,
scales each row by its routing weight and writes it to its pair's row, summed over the k slots in
torch. float32 accumulation, roundings where the reference rounds, and no host sync: the layer
can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.moe_align import ExpertBlocks, align_pairs_to_blocks
from pdserve.kernels.moe_dots import dot_options
from pdserve.kernels.moe_small_plan import use_small_batch


@triton.jit
def _gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    act_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    stride_ht,
    stride_hh,
    stride_we,
    stride_wn,
    stride_wk,
    stride_at,
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block): act[rows, cols] = silu(x @ gate^T) * (x @ up^T) for the
    block's pairs, x their tokens' hidden rows and gate, up the block's expert's projections."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows)
    row_mask = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter_size
    x_ptrs = hidden_ptr + tokens[:, None] * stride_ht
    # The gate rows 0..I and up rows I..2I of w13[expert], read transposed as [K, N] tiles.
    gate_ptrs = w13_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_ptrs = gate_ptrs + inter_size * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_size
        x = tl.load(
            x_ptrs + ks[None, :] * stride_hh, mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(gate_ptrs + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(up_ptrs + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION)
    # Round where the reference rounds: both projections, silu(gate), and the product.
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_at + cols[None, :]
    tl.store(out_ptrs, (silu * up).to(dtype), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    topk_weights_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    stride_at,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    num_pairs,
    hidden_size,
    inter_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block): out[pair, cols] = weight[pair] * (act[row] @ down^T)
    for the block's pairs, down the block's expert's projection."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows)
    row_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_at
    w_ptrs = w2_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < inter_size
        a = tl.load(a_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(
            w_ptrs + ks[:, None] * stride_wk, mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        if UPCAST_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    # The reference rounds the expert's output to the model dtype before weighting it in float32.
    weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, y, mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True, slots=True)
class MoeTileConfig:
    """Tile sizes and launch options of both MoE kernels."""

    block_m: int  # sorted pair rows per program, all of one expert
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


# From one sweep on an H200 (bfloat16, 64 experts, hidden 2048, intermediate 768, 8 per token,
# CUDA-graph replays): 1 token 73 us, 64 tokens 233, 512 tokens 335, 4096 tokens 983 (the first
# untuned defaults took 99, 326, 409 and 1434); the third tier's tiles were timed only at 4096
# tokens (1135 us; their 4-warp variant needs all 255 registers). Rows per block follow the pairs
# per expert, so decode steps (a few pairs per expert) pad little; tl.dot needs at least 16.
# float32 (tests, debugging) uses exact FMA dots, which need more registers: narrower tiles, not
# timed.
def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTileConfig:
    per_expert = -(-num_pairs // max(1, num_experts))
    if dtype == torch.float32:
        block_m = 16 if per_expert <= 16 else 32
        return MoeTileConfig(block_m, block_n=32, block_k=32, num_warps=4, num_stages=2)
    if per_expert <= 16:
        return MoeTileConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoeTileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    if per_expert <= 256:
        return MoeTileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return MoeTileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeTileConfig | None = None,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k] (float32) and topk_ids
    [T, k] from the router. Returns [T, H] in hidden's dtype: for each token the sum over its k
    experts of weight * down(silu(gate(x)) * up(x)), accumulated in float32.

    One to eight tokens run the split-K schedule of `triton_moe_small` (`moe_small_plan`), larger
    batches the grouped GEMM here. `config` forces the grouped GEMM with these tiles, else
    `moe_config` chooses them from the shapes (which alone decide every launch, so the op replays
    in a CUDA graph).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    inter_size = two_i // 2
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros(0, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    if config is None and use_small_batch(num_tokens):
        from pdserve.kernels.triton_moe_small import fused_moe_small  # it imports this module

        return fused_moe_small(hidden, w13, w2, topk_weights, topk_ids)
    config = config or moe_config(num_pairs, num_experts, hidden.dtype)
    schedule: ExpertBlocks = align_pairs_to_blocks(topk_ids, num_experts, config.block_m)
    num_blocks = schedule.block_expert.shape[0]
    topk_weights = topk_weights.reshape(-1).to(torch.float32)
    dots = dot_options(hidden.device, hidden.dtype)
    launch = dict(
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        BLOCK_N=config.block_n,
        **dots,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    act = torch.empty(
        schedule.sorted_pair_ids.shape[0], inter_size, dtype=hidden.dtype, device=hidden.device
    )
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, config.block_n))](
        hidden,
        w13,
        act,
        schedule.sorted_pair_ids,
        schedule.block_expert,
        hidden.stride(0),
        hidden.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        num_pairs,
        top_k,
        hidden_size,
        inter_size,
        **launch,
    )
    # Every pair's row is written exactly once: no zero fill needed.
    out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, config.block_n))](
        act,
        w2,
        topk_weights,
        out,
        schedule.sorted_pair_ids,
        schedule.block_expert,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        num_pairs,
        hidden_size,
        inter_size,
        **launch,
    )
    return out.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
