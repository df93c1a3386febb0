"""AutoAWQ's GEMM layout of 4-bit weights, both ways, in plain torch: dequantization (the ground
truth every faster path is tested against) and round-to-nearest quantization (how tests and
benchmarks write such checkpoints from float weights; AWQ's activation-aware search only
chooses other scales, the layout is the same).

A linear layer of `in` inputs and `out` outputs in groups of `group` inputs holds:
`qweight` int32 [in, out / 8] (eight outputs' 4-bit values per word, in `AWQ_ORDER`),
`qzeros` int32 [in / group, out / 8] (packed the same way) and `scales` float16
[in / group, out]; the weight is w[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o].
"""

from __future__ import annotations

import torch

from pdserve.engine.quant.int_packing import AWQ_ORDER, pack, unpack

BITS = 4
MAX_Q = 2**BITS - 1


def dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """float32 [out, in]: each 4-bit value minus its group's zero point, times its scale."""
    q = unpack(qweight, BITS, 1, AWQ_ORDER)  # [in, out]
    zeros = unpack(qzeros, BITS, 1, AWQ_ORDER)  # [groups, out]
    rows = torch.arange(q.shape[0], device=q.device) // group
    if tuple(scales.shape) != tuple(zeros.shape) or int(rows[-1]) >= scales.shape[0]:
        raise ValueError(
            f"AWQ scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not hold the "
            f"groups of {group} of a qweight {tuple(qweight.shape)}"
        )
    return ((q - zeros[rows]).float() * scales.float()[rows]).T.contiguous()


def quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, qzeros, scales) of a float weight [out, in]: each group's range over [0, 15]
    with a zero point, as AutoAWQ's `pseudo_quantize_tensor` rounds (scales kept in float16,
    and the values rounded by those)."""
    out, cols = weight.shape
    if cols % group:
        raise ValueError(f"{cols} inputs are not whole groups of {group}")
    w = weight.float().reshape(out, cols // group, group)
    hi, lo = w.amax(-1), w.amin(-1)
    scales = ((hi - lo).clamp(min=1e-5) / MAX_Q).half().float()
    zeros = (-torch.round(lo / scales)).clamp(0, MAX_Q)
    q = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp(0, MAX_Q)
    q = q.reshape(out, cols).to(torch.int32)
    return (
        pack(q.T, BITS, 1, AWQ_ORDER),
        pack(zeros.T.to(torch.int32), BITS, 1, AWQ_ORDER),
        scales.T.half().contiguous(),
    )
