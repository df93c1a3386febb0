"""A linear layer whose weight stays block-scaled FP8 in memory (with its float32 scales). On a
GPU, Triton's block-scaled GEMM reads it as it is (`gemm_choice` says which variant); elsewhere
it is dequantized into the activations' dtype on every call: the memory is the point, so nothing
dequantized is kept between calls (on CPU the dequantization, a pass over the whole weight, costs
far more than a decode step's matmul on a kept float copy: the price of the memory). Fused projections (q/k/v, gate/up) hold each part's rows
with that part's own scale rows, so a part whose rows end in a ragged block fuses too."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.quant.fp8_reference import FP8, scale_shape
from pdserve.engine.quant.gemm_choice import Fp8Gemm, fp8_gemm_on
from pdserve.engine.quant.linear import QuantLinear

if TYPE_CHECKING:  # the models import this layer; it only reads what they hand it
    from pdserve.engine.models.weights import CheckpointTensor
    from pdserve.engine.quant.linear import RankGroup


def _blocks(part: range, block: int) -> range:
    """The blocks that hold `part` of a dimension (a rank's share starts on a block boundary)."""
    return range(part.start // block, -(-part.stop // block))


def scale_row_index(
    out_parts: tuple[int, ...], block_rows: int, device: torch.device
) -> torch.Tensor:
    """Each weight row's scale row, where fused parts of `out_parts` rows each start a fresh
    grid of scale rows."""
    rows, scale_offset = [], 0
    for n in out_parts:
        rows.append(scale_offset + torch.arange(n, device=device) // block_rows)
        scale_offset += -(-n // block_rows)
    return torch.cat(rows)


def dequantize_rows(
    weight: torch.Tensor, row_scales: torch.Tensor, block_cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 weight [out, in] in `dtype`, given each row's scales [out, scale columns]: each
    element times its column block's scale."""
    # The row scales broadcast over the whole column blocks, then the ragged last block's
    # columns (a full [out, in] gather of scales is slower).
    weight = weight.to(torch.float32)
    out, cols = weight.shape
    whole = cols // block_cols * block_cols
    body = weight[:, :whole].view(out, -1, block_cols) * row_scales[:, : whole // block_cols, None]
    parts = [body.view(out, whole)]
    if whole < cols:
        parts.append(weight[:, whole:] * row_scales[:, -1:])
    return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).to(dtype)


class Fp8Linear(QuantLinear):
    kinds = ("weight", "weight_scale_inv")

    def __init__(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        block: tuple[int, int],
        group: RankGroup | None = None,
    ) -> None:
        """out_parts: the output rows of each fused projection in order (one part: unfused).
        With a group the layer is row-parallel: its input is this rank's share, its partial
        outputs are summed across ranks and the whole bias added once."""
        super().__init__()
        self.in_features = in_features
        self.out_parts = out_parts
        self.out_features = sum(out_parts)
        self.block = block
        self.group = group
        scale_rows = sum(-(-n // block[0]) for n in out_parts)
        scale_cols = -(-in_features // block[1])
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=FP8), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_rows, scale_cols, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self._index(self.weight.device)

    def _index(self, device: torch.device) -> None:
        """Each weight row's scale row (a plain attribute: a model built on the meta device makes
        it again where its weights land)."""
        self.scale_rows = scale_row_index(self.out_parts, self.block[0], device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # noqa: ANN202
        """Moves (and `to_empty`) reach the FP8 weight and its scales; dtype casts of the model
        (`model.to(torch.bfloat16)`) do not: they keep their stored dtypes."""
        device = fn(torch.empty(0, device=self.weight.device)).device
        for name in ("weight", "weight_scale_inv"):
            param = getattr(self, name)
            moved = torch.empty_like(param, device=device) if param.is_meta else param.to(device)
            setattr(self, name, nn.Parameter(moved, requires_grad=False))
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.detach()), requires_grad=False)
        self._index(device)
        return self

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`: each FP8 element times its block's scale."""
        row_scales = self.weight_scale_inv.index_select(0, self.scale_rows)
        return dequantize_rows(self.weight, row_scales, self.block[1], dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """On a GPU, Triton's block-scaled GEMM (`gemm_choice.fp8_gemm` picks FP8 dots or W8A16)
        reads the FP8 weight as it is; elsewhere the torch reference dequantizes it per call."""
        gemm = fp8_gemm_on(x.device)
        if gemm is Fp8Gemm.DEQUANTIZE:
            return super().matmul(x, bias)
        from pdserve.kernels import triton_fp8_block  # only where Triton runs

        kernel = (
            triton_fp8_block.fp8_block_matmul
            if gemm is Fp8Gemm.FP8
            else triton_fp8_block.w8a16_block_matmul
        )
        rows = x.reshape(-1, self.in_features)
        y = kernel(rows, self.weight, self.weight_scale_inv, self.block, self.scale_rows)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    # --- loading -------------------------------------------------------------------------------

    def load(
        self, kind: str, tensor: CheckpointTensor, dim: int, part: range, size: int, offset: int
    ) -> None:
        """Read this rank's `part` (of `size`, along `dim`: 0 rows, 1 columns) of a checkpoint
        projection's `weight` or `weight_scale_inv` into place; a fused part's rows go at row
        `offset`, its scale rows after the scale rows of the parts before it."""
        b0, b1 = self.block
        if dim == 0:
            full = (size, self.in_features)
        else:
            full = (self.out_features, size)
        if kind == "weight_scale_inv":
            full = scale_shape(full, self.block)
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full}"
                + (f" (blocks of {b0}x{b1})" if kind == "weight_scale_inv" else "")
            )
        stored = tensor.stored_dtype
        want = "F8_E4M3" if kind == "weight" else "F32"
        if stored != want:
            raise ValueError(
                f"weight '{tensor.name}' is stored as {stored}; an FP8 checkpoint "
                f"(quantization_config) stores it as {want}"
            )
        with torch.no_grad():
            if kind == "weight":
                target = self.weight.data
                if dim == 0:
                    target.narrow(0, offset, len(part)).copy_(tensor.read(rows=part, dtype=FP8))
                else:
                    target.copy_(tensor.read(columns=part, dtype=FP8))
                return
            target = self.weight_scale_inv.data
            if dim == 0:
                rows = _blocks(part, b0)
                start = self._scale_offset(offset)
                target.narrow(0, start, len(rows)).copy_(
                    tensor.read(rows=rows, dtype=torch.float32)
                )
            else:
                target.copy_(tensor.read(columns=_blocks(part, b1), dtype=torch.float32))

    def _scale_offset(self, row_offset: int) -> int:
        """The first scale row of the fused part whose rows start at row_offset."""
        rows = scales = 0
        for n in self.out_parts:
            if rows == row_offset:
                return scales
            rows += n
            scales += -(-n // self.block[0])
        raise ValueError(f"no fused part starts at row {row_offset} of {self.out_parts}")
