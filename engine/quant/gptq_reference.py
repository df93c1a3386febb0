"""AutoGPTQ's and GPTQModel's layout of 4- and 8-bit weights, both ways, in plain torch:
dequantization (the ground truth every faster path is tested against) and round-to-nearest
quantization per group (how tests and benchmarks write such checkpoints from float weights;
GPTQ's error feedback only chooses other values, the layout is the same).

A linear layer of `in` inputs and `out` outputs holds: `qweight` int32 [in * bits / 32, out]
(packed along the inputs, value i of a word in its bits i*bits and up), `qzeros` int32
[groups, out * bits / 32] (packed along the outputs), `scales` float16 [groups, out] and `g_idx`
int32 [in], each input's group: i // group_size, or with `desc_act` (act-order) any assignment,
the stored inputs staying in their original order. The weight is
w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], where the v1 format (`checkpoint_format`
"gptq", what most published checkpoints are) stores each zero point minus one (read back as
the stored value plus one, 1 to 2**bits, as AutoGPTQ's and vLLM's kernels do: zero 0 cannot be
said) and `gptq_v2` stores it as it is.
"""

from __future__ import annotations

import torch

from pdserve.engine.quant.int_packing import pack, unpack


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    v1: bool = True,
) -> torch.Tensor:
    """float32 [out, in]: each value minus its group's zero point, times its scale."""
    q = unpack(qweight, bits, 0)  # [in, out]
    zeros = stored_zeros(qzeros, bits, v1)  # [groups, out]
    groups = g_idx.long()
    if g_idx.shape != (q.shape[0],) or int(groups.max()) >= scales.shape[0] or groups.min() < 0:
        raise ValueError(
            f"g_idx {tuple(g_idx.shape)} (groups {int(groups.min())}..{int(groups.max())}) does "
            f"not index the {scales.shape[0]} groups of a qweight {tuple(qweight.shape)}"
        )
    return ((q - zeros[groups]).float() * scales.float()[groups]).T.contiguous()


def stored_zeros(qzeros: torch.Tensor, bits: int, v1: bool) -> torch.Tensor:
    """The zero points [groups, out] of packed `qzeros`: the stored values plus one for v1."""
    zeros = unpack(qzeros, bits, 1)
    return zeros + 1 if v1 else zeros


def quantize(
    weight: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    sym: bool,
    v1: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, qzeros, scales) of a float weight [out, in] whose inputs are grouped by
    `g_idx`: each group's range over [0, 2**bits - 1] by GPTQ's quantizer (symmetric: zero point
    2**(bits - 1) and the larger magnitude at the range's end; else the group's minimum and
    maximum, zero point rounded), scales kept in float16 and the values rounded by those. For
    v1, zero points are kept at one or more so that `zero - 1` is stored (see the module)."""
    max_q = 2**bits - 1
    w = weight.float()
    out, cols = w.shape
    num_groups = int(g_idx.max()) + 1
    scales = torch.empty(num_groups, out)
    zeros = torch.empty(num_groups, out)
    for g in range(num_groups):
        cols_g = w[:, g_idx == g]
        lo, hi = cols_g.amin(1).clamp(max=0), cols_g.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / max_q).clamp(min=1e-8).half().float()
        zero = torch.full_like(scale, (max_q + 1) / 2) if sym else torch.round(-lo / scale)
        scales[g], zeros[g] = scale, zero.clamp(1 if v1 else 0, max_q)
    groups = g_idx.long()
    q = (torch.round(w / scales[groups].T) + zeros[groups].T).clamp(0, max_q).to(torch.int32)
    stored = zeros.to(torch.int32) - (1 if v1 else 0)
    return pack(q.T, bits, 0), pack(stored, bits, 1), scales.half()


def act_order_groups(in_features: int, group: int, seed: int | None = None) -> torch.Tensor:
    """g_idx [in] int32: each input's group. Without a seed, i // group (desc_act false; one
    group for all when group is -1); with one, the inputs taken in a seeded random order (as
    act-order takes them by their Hessian's diagonal) and grouped in that order."""
    size = in_features if group == -1 else group
    ordered = torch.arange(in_features, dtype=torch.int32) // size
    if seed is None:
        return ordered
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty_like(ordered)
    g_idx[perm] = ordered
    return g_idx
