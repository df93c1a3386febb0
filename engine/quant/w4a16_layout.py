"""AWQ's and GPTQ's 4-bit storage rewritten once into the layout Triton's W4A16 GEMM reads, and
read back, in plain torch: what their layers hold on a GPU once loaded (one copy, not two).

The kernel's layout (`w4a16_ref`): qweight int32 [N, ceil(K / 8)], eight unsigned 4-bit values
a word along the inputs K, lowest bits first; scales [N, groups] (kept float16, as stored);
zero points uint8 [N, groups]; the group of input k is k // G. AWQ packs along the outputs in
its own nibble order: unpacked and packed again along K. GPTQ packs along K already: its words
are transposed, its zero points (packed along the outputs, v1 one less) unpacked.

GPTQ with act-order (`desc_act`) puts inputs in groups in any order: the inputs are sorted by
group (stably), each group's columns then contiguous, and the layer multiplies x[:, perm] by the
weight whose columns are in that order. Each fused part has its own order, so its own `perm`
row; a layout whose sorted groups are not runs of G (a row-parallel rank's share of act-order
inputs) has no such order and stays in torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.quant.gptq_reference import stored_zeros
from pdserve.engine.quant.int_packing import AWQ_ORDER, unpack

BITS = 4
PER_WORD = 8
MIN_STEP = 16  # the kernel steps through K in powers of two of at least 16 inside one group
# Outputs unpacked at a time while converting: the int32 values of a chunk (K x 4096 x 4 bytes,
# 224 MiB for K = 14336) are the conversion's only large temporary, whatever the layer's width.
CHUNK = 4096

# (x [M, K], qweight, scales, zeros, group_size) -> [M, N]: `triton_w4a16.w4a16_matmul`, or
# its torch reference `w4a16_ref.w4a16_matmul_ref` (how the CPU tests run these operands).
Gemm = Callable[..., torch.Tensor]


def kernel_reads(group: int, in_features: int) -> bool:
    """Whether the kernel takes groups of `group` inputs over `in_features`: one group for the
    whole row, or groups of a multiple of 16 (its K step stays inside one group)."""
    return group >= in_features or group % MIN_STEP == 0


def pack_along_k(values: torch.Tensor) -> torch.Tensor:
    """int32 [N, ceil(K / 8)] of 4-bit values [N, K], eight a word along K, lowest bits first
    (a ragged last word padded with zeros); only word-sized temporaries, not 64-bit copies of
    every value."""
    n, k = values.shape
    words = torch.zeros(n, -(-k // PER_WORD), dtype=torch.int64, device=values.device)
    for j in range(PER_WORD):
        column = values[:, j::PER_WORD].to(torch.int64) << (BITS * j)
        words[:, : column.shape[1]] |= column
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_operands(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight [N, ceil(K / 8)], scales [N, groups], zeros [N, groups]) of AutoAWQ's qweight
    [K, N / 8], qzeros [groups, N / 8] (both packed along N in `AWQ_ORDER`) and scales
    [groups, N]."""
    step = CHUNK // PER_WORD  # packed words of CHUNK outputs
    words = [
        pack_along_k(unpack(qweight[:, c : c + step], BITS, 1, AWQ_ORDER).T)  # [outputs, K]
        for c in range(0, qweight.shape[1], step)
    ]
    zeros = unpack(qzeros, BITS, 1, AWQ_ORDER).T.to(torch.uint8)
    return torch.cat(words), scales.T.contiguous(), zeros.contiguous()


def act_order(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input order [K] (int32) that makes each group's inputs contiguous runs of `group`
    (group k // group at position k): None when g_idx is that already; raises ValueError when
    no order does (groups of other sizes)."""
    k = g_idx.shape[0]
    runs = torch.arange(k, device=g_idx.device, dtype=g_idx.dtype) // group
    if torch.equal(g_idx, runs):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], runs):
        raise ValueError("the inputs' groups are not runs of the group size in any order")
    return perm.to(torch.int32)


def gptq_operands(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    out_parts: tuple[int, ...],
    group: int,
    v1: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight [N, K / 8], scales [N, groups], zeros [N, groups], perm or None) of 4-bit
    GPTQ's qweight [K / 8, N], qzeros [groups, N / 8], scales [groups, N] and g_idx [parts, K]
    (each fused part's inputs' groups, in groups of `group` inputs). With act-order each part's
    words are repacked in its input order, perm [parts, K] (one row when all parts share it).
    Raises ValueError where no order fits."""
    zeros = stored_zeros(qzeros, BITS, v1).T.to(torch.uint8).contiguous()
    orders = [act_order(row, group) for row in g_idx]
    if all(order is None for order in orders):  # already along K: the words as they are
        return qweight.T.contiguous(), scales.T.contiguous(), zeros, None
    k = g_idx.shape[1]
    identity = torch.arange(k, dtype=torch.int32, device=g_idx.device)
    perm = torch.stack([identity if order is None else order for order in orders])
    if bool((perm == perm[0]).all()):
        perm = perm[:1]  # one order for all parts: the layer permutes x once
    words, start = [], 0
    for i, n in enumerate(out_parts):
        order = part_order(perm, i)
        for c in range(start, start + n, CHUNK):
            values = unpack(qweight[:, c : min(c + CHUNK, start + n)], BITS, 0)  # [K, outputs]
            words.append(pack_along_k(values.index_select(0, order).T))
        start += n
    return torch.cat(words), scales.T.contiguous(), zeros, perm


def part_order(perm: torch.Tensor, part: int) -> torch.Tensor:
    """Fused part `part`'s input order: its row of perm, or the one row all parts share."""
    return perm[part if len(perm) > 1 else 0]


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    perm: torch.Tensor | None,
    out_parts: tuple[int, ...],
    in_features: int,
) -> torch.Tensor:
    """float32 [N, K] of the kernel's operands, the inputs back in the checkpoint's order: each
    value less its group's zero point, times its group's scale."""
    k = in_features
    values = unpack(qweight, BITS, 1)[:, :k].float()  # [N, K], input k's group k // group
    groups = torch.arange(k, device=qweight.device) // group
    w = (values - zeros.float()[:, groups]) * scales.float()[:, groups]
    if perm is None:
        return w
    restored, start = torch.empty_like(w), 0
    for i, n in enumerate(out_parts):
        restored[start : start + n, part_order(perm, i).long()] = w[start : start + n]
        start += n
    return restored


def matmul(
    x: torch.Tensor,
    gemm: Gemm,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    perm: torch.Tensor | None,
    out_parts: tuple[int, ...],
) -> torch.Tensor:
    """x [M, K] @ weight^T by `gemm` on the kernel's operands: one call, on x's columns in the
    order `perm` where all parts share one; else one call per fused part."""
    if perm is None:
        return gemm(x, qweight, scales, zeros, group)
    if len(perm) == 1:
        return gemm(x.index_select(1, perm[0]), qweight, scales, zeros, group)
    outs, start = [], 0
    for i, n in enumerate(out_parts):
        rows = slice(start, start + n)
        outs.append(
            gemm(x.index_select(1, perm[i]), qweight[rows], scales[rows], zeros[rows], group)
        )
        start += n
    return torch.cat(outs, dim=1)
