"""The fused mixture-of-experts MLP of `triton_moe` over experts whose weights stay block-scaled
FP8 (DeepSeek-V3's routed experts): the same grouped GEMM over the (token, slot) pairs sorted by
expert, with each tile's weight bytes decoded in registers and each K step's partial product
scaled by its block's `weight_scale_inv` (W8A16: the activations stay in their dtype).

Stacked experts: w13 [E, 2I, H] float8_e4m3fn with w13_scale [E, 2 * ceil(I / bn), ceil(H / bk)]
(the gate's scale rows, then the up projection's: each keeps its own, as checkpoints store them),
w2 [E, H, I] with w2_scale [E, ceil(H / bn), ceil(I / bk)]. Ground truth: `moe_ref.fused_moe` on
the dequantized weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.moe_align import align_pairs_to_blocks
from pdserve.kernels.triton_e4m3 import e4m3_to_float32
from pdserve.kernels.triton_moe import MoeTileConfig, moe_config
from pdserve.kernels.triton_w4a16 import dot_options


@triton.jit
def _fp8_gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    scale_ptr,
    act_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    stride_ht,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_at,
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    up_scale_row,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block): act = silu(x @ gate^T) * (x @ up^T) for the block's
    pairs, gate and up decoded from the block's expert's FP8 rows block by block."""
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
    gate_ptrs = w13_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_ptrs = gate_ptrs + inter_size * stride_wn
    gate_scales = scale_ptr + expert * stride_se + (cols // SCALE_BLOCK_N) * stride_sn
    up_scales = gate_scales + up_scale_row * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dtype = act_ptr.dtype.element_ty
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_size
        x = tl.load(x_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = e4m3_to_float32(tl.load(gate_ptrs + ks[:, None], mask=w_mask, other=0)).to(dtype)
        w_up = e4m3_to_float32(tl.load(up_ptrs + ks[:, None], mask=w_mask, other=0)).to(dtype)
        kb = k0 // SCALE_BLOCK_K  # the step lies inside one K block
        s_gate = tl.load(gate_scales + kb, mask=col_mask, other=0.0)
        s_up = tl.load(up_scales + kb, mask=col_mask, other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        gate += tl.dot(x, w_gate, input_precision=DOT_PRECISION) * s_gate[None, :]
        up += tl.dot(x, w_up, input_precision=DOT_PRECISION) * s_up[None, :]
    # Round where the reference rounds: both projections, silu(gate), and the product.
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_at + cols[None, :]
    tl.store(out_ptrs, (silu * up).to(dtype), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _fp8_down_kernel(
    act_ptr,
    w2_ptr,
    scale_ptr,
    topk_weights_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    stride_at,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    num_pairs,
    hidden_size,
    inter_size,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (row block, column block): out[pair, cols] = weight[pair] * (act[row] @ down^T),
    down decoded from the block's expert's FP8 rows block by block."""
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
    s_ptrs = scale_ptr + expert * stride_se + (cols // SCALE_BLOCK_N) * stride_sn
    dtype = act_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < inter_size
        a = tl.load(a_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_bytes = tl.load(w_ptrs + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
        w = e4m3_to_float32(w_bytes).to(dtype)
        s = tl.load(s_ptrs + k0 // SCALE_BLOCK_K, mask=col_mask, other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION) * s[None, :]
    # The reference rounds the expert's output to the model dtype before weighting it in float32.
    weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, y, mask=row_mask[:, None] & col_mask[None, :])


def fp8_moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTileConfig:
    """`moe_config`'s tiles, at most 64 rows a block: the 128-row tier decodes two 64x128 weight
    tiles a step in registers and spills on sm_90. Not yet timed on a GPU."""
    config = moe_config(num_pairs, num_experts, dtype)
    if config.block_m <= 64:
        return config
    return MoeTileConfig(64, config.block_n, config.block_k, config.num_warps, config.num_stages)


def _check_scales(name: str, scale: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name} must be {list(expected)}, got {list(scale.shape)}")


def fused_moe_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block: tuple[int, int],
    config: MoeTileConfig | None = None,
) -> torch.Tensor:
    """hidden [T, H]; w13, w2 float8_e4m3fn experts with their block scales (module docstring);
    topk_weights [T, k] and topk_ids [T, k] from the router. Returns [T, H] in hidden's dtype:
    `moe_ref.fused_moe` on the dequantized experts, accumulated in float32."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    inter_size = two_i // 2
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        raise ValueError(
            f"weight_block_size {list(block)}: the fused MoE needs a K block that is a power "
            "of two of at least 16"
        )
    inter_blocks = -(-inter_size // bn)
    _check_scales("w13_scale", w13_scale, (num_experts, 2 * inter_blocks, -(-hidden_size // bk)))
    _check_scales("w2_scale", w2_scale, (num_experts, -(-hidden_size // bn), -(-inter_size // bk)))
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
    config = config or fp8_moe_config(num_pairs, num_experts, hidden.dtype)
    schedule = align_pairs_to_blocks(topk_ids, num_experts, config.block_m)
    num_blocks = schedule.block_expert.shape[0]
    topk_weights = topk_weights.reshape(-1).to(torch.float32)
    launch = dict(
        SCALE_BLOCK_N=bn,
        SCALE_BLOCK_K=bk,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=min(config.block_k, bk),  # each step inside one scale block
        **dot_options(hidden.device, hidden.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    w13_bytes, w2_bytes = w13.view(torch.uint8), w2.view(torch.uint8)
    act = torch.empty(
        schedule.sorted_pair_ids.shape[0], inter_size, dtype=hidden.dtype, device=hidden.device
    )
    _fp8_gate_up_kernel[(num_blocks, triton.cdiv(inter_size, config.block_n))](
        hidden,
        w13_bytes,
        w13_scale,
        act,
        schedule.sorted_pair_ids,
        schedule.block_expert,
        hidden.stride(0),
        w13_bytes.stride(0),
        w13_bytes.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        act.stride(0),
        num_pairs,
        top_k,
        hidden_size,
        inter_size,
        inter_blocks,
        **launch,
    )
    out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    _fp8_down_kernel[(num_blocks, triton.cdiv(hidden_size, config.block_n))](
        act,
        w2_bytes,
        w2_scale,
        topk_weights,
        out,
        schedule.sorted_pair_ids,
        schedule.block_expert,
        act.stride(0),
        w2_bytes.stride(0),
        w2_bytes.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        out.stride(0),
        num_pairs,
        hidden_size,
        inter_size,
        **launch,
    )
    return out.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
