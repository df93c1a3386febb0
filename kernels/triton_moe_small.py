"""Triton fused MoE for one to eight tokens (`moe_small_plan`): the grouped GEMM of `triton_moe`
with each reduction split over many programs, so the few active experts' weights stream from
many SMs at once. Matches `moe_ref.fused_moe` as `triton_moe.fused_moe` does, which runs it for
such batches.

The pairs are scheduled into 16-row blocks of one expert (`moe_align`); at eight tokens an
expert's pairs fill one block. The gate/up kernel writes each slice of hidden's float32 partial
sums of gate and up; the down kernel adds those slices in order, rounds and applies silu(gate) *
up where the reference does, and writes its own slices of the down projection, a row per pair;
the combine kernel adds those in order, rounds each pair's expert output and sums the k weighted
outputs of each token. No atomics and no host sync: the result is deterministic and the layer
replays in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.moe_align import align_pairs_to_blocks
from pdserve.kernels.moe_dots import dot_options
from pdserve.kernels.moe_small_plan import DEFAULT_SM_COUNT, SmallMoePlan, plan_small_moe


@triton.jit
def _gate_up_split_kernel(
    hidden_ptr,
    w13_ptr,
    partial_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    stride_ht,
    stride_hh,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ps,
    stride_pr,
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block, slice): partial[slice, rows, cols] = x @ gate^T and
    partial[slice, rows, I + cols] = x @ up^T over the slice's columns of hidden, in float32."""
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
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, hidden_size)
    x_ptrs = hidden_ptr + tokens[:, None] * stride_ht
    gate_ptrs = w13_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_ptrs = gate_ptrs + inter_size * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
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
    out_ptrs = (
        partial_ptr
        + tl.program_id(2).to(tl.int64) * stride_ps
        + rows.to(tl.int64)[:, None] * stride_pr
        + cols[None, :]
    )
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptrs, gate, mask=mask)
    tl.store(out_ptrs + inter_size, up, mask=mask)


@triton.jit
def _down_split_kernel(
    gate_up_ptr,
    w2_ptr,
    partial_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    stride_gs,
    stride_gr,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ps,
    stride_pp,
    num_pairs,
    hidden_size,
    inter_size,
    k_per_split,
    gate_up_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block, slice): partial[slice, pairs, cols] = act @ down^T over
    the slice's columns of the width, act = silu(gate) * up from the gate/up slices summed."""
    dtype = w2_ptr.dtype.element_ty
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows)
    row_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, inter_size)
    g_ptrs = gate_up_ptr + rows.to(tl.int64)[:, None] * stride_gr
    w_ptrs = w2_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        a_mask = row_mask[:, None] & k_mask[None, :]
        gate = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for s in range(0, gate_up_splits):  # the gate/up slices, always in the same order
            slice_ptrs = g_ptrs + s * stride_gs + ks[None, :]
            gate += tl.load(slice_ptrs, mask=a_mask, other=0.0)
            up += tl.load(slice_ptrs + inter_size, mask=a_mask, other=0.0)
        # Round where the reference rounds: both projections, silu(gate), and the product.
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        a = (silu * up).to(dtype)
        w = tl.load(
            w_ptrs + ks[:, None] * stride_wk, mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        if UPCAST_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    out_ptrs = (
        partial_ptr
        + tl.program_id(2).to(tl.int64) * stride_ps
        + pairs.to(tl.int64)[:, None] * stride_pp
        + cols[None, :]
    )
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _combine_kernel(
    partial_ptr,
    topk_weights_ptr,
    out_ptr,
    stride_ps,
    stride_pp,
    stride_ot,
    hidden_size,
    top_k,
    down_splits,
    BLOCK_N: tl.constexpr,
):
    """Program (token, column block): out[token, cols] = the sum over the token's k pairs of
    weight * round(the pair's down slices summed in order), rounded to the model dtype."""
    dtype = out_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK_N], tl.float32)
    for slot in range(0, top_k):
        pair = token * top_k + slot
        y = tl.zeros([BLOCK_N], tl.float32)
        for s in range(0, down_splits):
            y += tl.load(
                partial_ptr + s * stride_ps + pair * stride_pp + cols, mask=mask, other=0.0
            )
        # The reference rounds each expert's output to the model dtype before weighting it.
        acc += y.to(dtype).to(tl.float32) * tl.load(topk_weights_ptr + pair)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(dtype), mask=mask)


# Output columns per program of the combine (float32 vectors, no dot).
COMBINE_BLOCK_N = 256


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_moe_small(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    plan: SmallMoePlan | None = None,
) -> torch.Tensor:
    """`triton_moe.fused_moe` for one to eight tokens (same arguments and result), on the
    split-K schedule `plan` (by default `plan_small_moe`'s for these shapes and this GPU)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    inter_size = two_i // 2
    num_pairs = num_tokens * top_k
    plan = plan or plan_small_moe(
        num_tokens,
        top_k,
        num_experts,
        hidden_size,
        inter_size,
        hidden.dtype,
        _sm_count(hidden.device),
    )
    if plan is None:
        raise ValueError(f"fused_moe_small runs 1 to 8 tokens, not {num_tokens}")
    schedule = align_pairs_to_blocks(topk_ids, num_experts, plan.block_m)
    rows = schedule.sorted_pair_ids.shape[0]
    num_blocks = schedule.block_expert.shape[0]
    launch = dict(
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        **dot_options(hidden.device, hidden.dtype),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    # Rows of padding (and of unused blocks) are never written nor read back.
    gate_up = torch.empty(
        plan.gate_up.splits, rows, two_i, dtype=torch.float32, device=hidden.device
    )
    _gate_up_split_kernel[(num_blocks, triton.cdiv(inter_size, plan.block_n), plan.gate_up.splits)](
        hidden,
        w13,
        gate_up,
        schedule.sorted_pair_ids,
        schedule.block_expert,
        hidden.stride(0),
        hidden.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        gate_up.stride(0),
        gate_up.stride(1),
        num_pairs,
        top_k,
        hidden_size,
        inter_size,
        plan.gate_up.per_split,
        **launch,
    )
    # Rows by pair: every pair's row of every slice is written once, no zero fill needed.
    down = torch.empty(
        plan.down.splits, num_pairs, hidden_size, dtype=torch.float32, device=hidden.device
    )
    _down_split_kernel[(num_blocks, triton.cdiv(hidden_size, plan.block_n), plan.down.splits)](
        gate_up,
        w2,
        down,
        schedule.sorted_pair_ids,
        schedule.block_expert,
        gate_up.stride(0),
        gate_up.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        down.stride(0),
        down.stride(1),
        num_pairs,
        hidden_size,
        inter_size,
        plan.down.per_split,
        plan.gate_up.splits,
        **launch,
    )
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _combine_kernel[(num_tokens, triton.cdiv(hidden_size, COMBINE_BLOCK_N))](
        down,
        topk_weights.reshape(-1).to(torch.float32),
        out,
        down.stride(0),
        down.stride(1),
        out.stride(0),
        hidden_size,
        top_k,
        plan.down.splits,
        BLOCK_N=COMBINE_BLOCK_N,
        num_warps=4,
    )
    return out
