"""A linear layer whose weight stays in AutoAWQ's GEMM layout in memory (4-bit values packed
eight outputs to an int32 word, their zero points packed the same way, float16 scales per group
of inputs) and is dequantized into the activations' dtype on every call; on a GPU with the W4A16
kernel it is repacked along the inputs once loaded (`w4a16_layout.awq_operands`). Fused
projections (q/k/v, gate/up) hold their parts side by side along the outputs: each part's packed
columns, zero points and scales in its own output range."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.quant import w4a16_layout
from pdserve.engine.quant.awq_reference import BITS
from pdserve.engine.quant.int_packing import AWQ_ORDER, unpack
from pdserve.engine.quant.packed_linear import PackedLinear, word_range, words

if TYPE_CHECKING:
    from pdserve.engine.models.weights import CheckpointTensor
    from pdserve.engine.quant.linear import RankGroup

PER_WORD = 32 // BITS


class AwqLinear(PackedLinear):
    kinds = ("qweight", "qzeros", "scales")
    format_name = "AWQ"

    def __init__(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        group_size: int,
        group: RankGroup | None = None,
    ) -> None:
        """out_parts: the output rows of each fused projection in order (one part: unfused),
        each a whole number of packed words. With a group the layer is row-parallel: its input
        is this rank's share (whole groups), its partial outputs summed across ranks."""
        super().__init__()
        self.in_features = in_features
        self.out_parts = out_parts
        self.out_features = sum(out_parts)
        self.group_size = group_size
        self.group = group
        for n in out_parts:
            words(n, PER_WORD, "an AWQ projection's output rows")
        groups = -(-in_features // group_size)
        self._hold("qweight", (in_features, self.out_features // PER_WORD))
        self._hold("qzeros", (groups, self.out_features // PER_WORD))
        self._hold("scales", (groups, self.out_features))
        self.bias = torch.nn.Parameter(torch.empty(self.out_features)) if bias else None

    def published_to_kernel(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not w4a16_layout.kernel_reads(self.group_size, self.in_features):
            raise ValueError(f"AWQ group_size {self.group_size} is not a multiple of 16")
        return (*w4a16_layout.awq_operands(self.qweight, self.qzeros, self.scales), None)

    def published_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` (as `awq_reference.dequantize`, computed in float32):
        each 4-bit value minus its group's zero point, times its group's scale."""
        # Small integers are exact in float32, where the arithmetic is faster than in int32.
        q = unpack(self.qweight, BITS, 1, AWQ_ORDER).float()  # [in, out]
        zeros = unpack(self.qzeros, BITS, 1, AWQ_ORDER).float()
        scales = self.scales.float()
        n, g = self.in_features, self.group_size
        if n % g == 0:  # whole groups: broadcast over each group's inputs
            w = (q.view(-1, g, q.shape[1]) - zeros[:, None]) * scales[:, None]
            w = w.view(n, -1)
        else:
            rows = torch.arange(n, device=q.device) // g
            w = (q - zeros[rows]) * scales[rows]
        return w.T.to(dtype)

    def load(
        self, kind: str, tensor: CheckpointTensor, dim: int, part: range, size: int, offset: int
    ) -> None:
        """Read this rank's `part` (of `size`, along `dim`: 0 output rows, 1 inputs) of a
        projection's `qweight`, `qzeros` or `scales`; a fused part's outputs go at `offset`."""
        self._published()
        g = self.group_size
        out, n = (size, self.in_features) if dim == 0 else (self.out_features, size)
        full = {
            "qweight": (n, words(out, PER_WORD, "output rows")),
            "qzeros": (-(-n // g), out // PER_WORD),
            "scales": (-(-n // g), out),
        }[kind]
        target = getattr(self, kind).data
        packed = kind != "scales"  # qweight and qzeros pack the outputs eight to a word
        with torch.no_grad():
            if dim == 0:
                cols = word_range(part, PER_WORD) if packed else part
                start = offset // PER_WORD if packed else offset
                target.narrow(1, start, len(cols)).copy_(
                    self._read(kind, tensor, full, columns=cols)
                )
            else:
                rows = part if kind == "qweight" else range(part.start // g, -(-part.stop // g))
                target.copy_(self._read(kind, tensor, full, rows=rows))
