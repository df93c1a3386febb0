"""gpt-oss's experts kept in MXFP4 in memory, as the checkpoint stores them (uint8 blocks of FP4
pairs and uint8 E8M0 scales: about a quarter of bf16's bytes), one expert dequantized at a time,
on the call that routes tokens to it (nothing dequantized is kept between calls: the memory is
the point).

A tensor-parallel rank holds its columns [a, b) of every expert, as the float experts split:
gate_up_proj's rows [2a, 2b) (gate and up alternate, gate j in row 2j, up j in row 2j + 1) and
down_proj's input columns [a, b), which it reads as the whole blocks that hold them (a share need
not start on a block of 32: gpt-oss-120b's 2880 columns split in 4 are 720, 22.5 blocks), and
drops the other ranks' columns of its edge blocks after dequantizing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.quant.mxfp4_reference import BLOCK, block_shapes, dequantize

if TYPE_CHECKING:  # the models hand this layer their checkpoint tensors
    from pdserve.engine.models.weights import CheckpointTensor


class Mxfp4Experts(nn.Module):
    """Every expert's gate_up_proj [2 x width, hidden] and down_proj [hidden, width] (logical
    [out, in] terms) of this rank's `columns`, as blocks and scales; `gate_up(e)` and `down(e)`
    dequantize one expert's."""

    # The checkpoint tensors `load` reads, after `mlp.experts.`.
    kinds = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")

    def __init__(self, num_experts: int, hidden: int, width: int, columns: range) -> None:
        """width: every expert's intermediate width in the checkpoint; columns: this rank's."""
        super().__init__()
        for field, value in (("hidden_size", hidden), ("intermediate_size", width)):
            if value % BLOCK:
                raise ValueError(
                    f"config.json field '{field}' = {value} is not a multiple of {BLOCK}: MXFP4 "
                    f"experts (quantization_config) hold their inputs in blocks of {BLOCK}"
                )
        self.num_experts = num_experts
        self.hidden = hidden
        self.width = width
        self.columns = columns
        # down_proj's input blocks that hold this rank's columns, and where they start in them.
        self.down_groups = range(columns.start // BLOCK, -(-columns.stop // BLOCK))
        self.down_skip = columns.start - self.down_groups.start * BLOCK
        ours = len(columns)
        shapes = {
            "gate_up_proj": block_shapes((num_experts, 2 * ours, hidden)),
            "down_proj": block_shapes((num_experts, hidden, len(self.down_groups) * BLOCK)),
        }
        for proj, (blocks, scales) in shapes.items():
            for kind, shape in (("blocks", blocks), ("scales", scales)):
                param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
                self.register_parameter(f"{proj}_{kind}", param)

    def gate_up(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s gate/up rows [2 x columns, hidden] (gate and up alternating)."""
        return dequantize(self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert], dtype)

    def down(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s down projection [hidden, columns]."""
        weight = dequantize(self.down_proj_blocks[expert], self.down_proj_scales[expert], dtype)
        return weight[:, self.down_skip : self.down_skip + len(self.columns)]

    # --- loading -------------------------------------------------------------------------------

    def _full_shape(self, kind: str) -> tuple[int, ...]:
        """The checkpoint's shape of `kind` (every column of every expert)."""
        proj, part = kind.rsplit("_", 1)
        if proj == "gate_up_proj":
            shape = (self.num_experts, 2 * self.width, self.hidden)
        else:
            shape = (self.num_experts, self.hidden, self.width)
        blocks, scales = block_shapes(shape)
        return blocks if part == "blocks" else scales

    def load(self, kind: str, tensor: CheckpointTensor) -> None:
        """Read this rank's part of one checkpoint tensor (`kind`, one of `kinds`); raise naming
        it if misshapen or not stored as uint8."""
        full = self._full_shape(kind)
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full} "
                f"(MXFP4: [experts, out, in / {BLOCK}{', 16' if kind.endswith('blocks') else ''}])"
            )
        if tensor.stored_dtype != "U8":
            raise ValueError(
                f"weight '{tensor.name}' is stored as {tensor.stored_dtype}; an MXFP4 checkpoint "
                "(quantization_config) stores it as U8"
            )
        experts, cols = range(self.num_experts), self.columns
        if kind.startswith("gate_up_proj"):  # this rank's rows, gate and up alternating
            part = tensor.read_slices(
                experts, range(2 * cols.start, 2 * cols.stop), dtype=torch.uint8
            )
        else:  # the input blocks that hold this rank's columns
            groups = self.down_groups
            part = tensor.read_slices(experts, range(self.hidden), groups, dtype=torch.uint8)
        with torch.no_grad():
            getattr(self, kind).data.copy_(part)
