"""A mixture of experts' weights kept block-scaled FP8 in memory (DeepSeek-V3/R1's and the Qwen3
MoE `-FP8` checkpoints' experts): every expert's gate/up and down projections stacked in FP8 with
their float32 block scales, and an expert's two matrices dequantized into the activations' dtype
only when a step routes tokens to it, so a step touches the experts it uses and nothing
dequantized is kept between steps. On a GPU with bf16 tensor cores and Triton
(`gemm_choice.fp8_moe_kernel`) the stack runs the fused MoE kernel instead
(`kernels/triton_moe_fp8.py`), which decodes the FP8 weights in registers, reads the routes on
the device alone, and so lets the model's decode steps be captured in CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.engine.quant.experts import QuantExperts
from pdserve.engine.quant.fp8_linear import dequantize_rows, scale_row_index
from pdserve.engine.quant.fp8_reference import FP8, scale_shape
from pdserve.engine.quant.gemm_choice import fp8_moe_kernel_on

if TYPE_CHECKING:
    from pdserve.engine.models.weights import CheckpointTensor


def _blocks(part: range, block: int) -> range:
    """The blocks that hold `part` of a dimension (a rank's share starts on a block boundary)."""
    return range(part.start // block, -(-part.stop // block))


class Fp8Experts(QuantExperts):
    """`w13[e]` expert e's gate projection above its up projection, `w2[e]` its down
    projection (this rank's `width` columns of each), as float8_e4m3fn; `w13_scale_inv[e]` the
    gate's scale rows above the up's (each part its own grid, so a width ending in a ragged
    block stacks too), `w2_scale_inv[e]` the down projection's."""

    kinds = ("weight", "weight_scale_inv")

    def __init__(
        self, num_experts: int, width: int, hidden_size: int, block: tuple[int, int]
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.width = width
        self.hidden_size = hidden_size
        self.block = block
        b0, b1 = block
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * width, hidden_size, dtype=FP8), requires_grad=False
        )
        self.w13_scale_inv = nn.Parameter(
            torch.empty(num_experts, 2 * -(-width // b0), -(-hidden_size // b1)),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, width, dtype=FP8), requires_grad=False
        )
        self.w2_scale_inv = nn.Parameter(
            torch.empty(num_experts, -(-hidden_size // b0), -(-width // b1)),
            requires_grad=False,
        )
        self._index(self.w13.device)

    def _index(self, device: torch.device) -> None:
        """Each weight row's scale row (plain attributes, made again where the weights land)."""
        self.rows13 = scale_row_index((self.width, self.width), self.block[0], device)
        self.rows2 = scale_row_index((self.hidden_size,), self.block[0], device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # noqa: ANN202
        """Moves (and `to_empty`) reach the FP8 weights and their float32 scales; dtype casts of
        the model do not."""
        device = fn(torch.empty(0, device=self.w13.device)).device
        for name in ("w13", "w13_scale_inv", "w2", "w2_scale_inv"):
            param = getattr(self, name)
            moved = torch.empty_like(param, device=device) if param.is_meta else param.to(device)
            setattr(self, name, nn.Parameter(moved, requires_grad=False))
        self._index(device)
        return self

    def runs_kernel(self) -> bool:
        """Whether this stack's device runs the fused FP8 MoE kernel (else the torch path)."""
        return fp8_moe_kernel_on(self.w13.device, self.block[1])

    @property
    def eager_only(self) -> str | None:
        """None where the fused kernel runs: its schedule is built on the device, sized by
        shapes alone, with no host sync."""
        return None if self.runs_kernel() else super().eager_only

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The fused kernel on the stacked FP8 weights and their scales as they are (the gate's
        and the up projection's scale rows apart, as the kernel reads them), or each routed
        expert dequantized in torch."""
        if not self.runs_kernel():
            return super().forward(x, weights, ids)
        from pdserve.kernels.triton_moe_fp8 import fused_moe_fp8  # only where Triton runs

        return fused_moe_fp8(
            x.contiguous(),
            self.w13,
            self.w13_scale_inv,
            self.w2,
            self.w2_scale_inv,
            weights,
            ids,
            self.block,
        )

    def dequantized(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s (w13 [2 * width, hidden], w2 [hidden, width]) in `dtype`."""
        b1 = self.block[1]
        scales13 = self.w13_scale_inv[expert].index_select(0, self.rows13)
        scales2 = self.w2_scale_inv[expert].index_select(0, self.rows2)
        return (
            dequantize_rows(self.w13[expert], scales13, b1, dtype),
            dequantize_rows(self.w2[expert], scales2, b1, dtype),
        )

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s gated MLP on the rows x routed to it."""
        w13, w2 = self.dequantized(expert, x.dtype)
        gate, up = F.linear(x, w13).split(self.width, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    # --- loading -------------------------------------------------------------------------------

    def load(
        self,
        kind: str,
        tensor: CheckpointTensor,
        expert: int,
        role: str,
        columns: range,
        full_width: int,
    ) -> None:
        """Read this rank's `columns` (of `full_width`) of expert `expert`'s `role` projection
        (gate, up or down): its `weight` or `weight_scale_inv`."""
        b0, b1 = self.block
        full = (self.hidden_size, full_width) if role == "down" else (full_width, self.hidden_size)
        if kind == "weight_scale_inv":
            full = scale_shape(full, self.block)
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full}"
                + (f" (blocks of {b0}x{b1})" if kind == "weight_scale_inv" else "")
            )
        want = "F8_E4M3" if kind == "weight" else "F32"
        if tensor.stored_dtype != want:
            raise ValueError(
                f"weight '{tensor.name}' is stored as {tensor.stored_dtype}; an FP8 checkpoint "
                f"(quantization_config) stores it as {want}"
            )
        with torch.no_grad():
            if kind == "weight" and role == "down":
                self.w2.data[expert].copy_(tensor.read(columns=columns, dtype=FP8))
            elif kind == "weight":
                offset = 0 if role == "gate" else self.width
                rows = self.w13.data[expert].narrow(0, offset, len(columns))
                rows.copy_(tensor.read(rows=columns, dtype=FP8))
            elif role == "down":
                blocks = _blocks(columns, b1)
                self.w2_scale_inv.data[expert].copy_(
                    tensor.read(columns=blocks, dtype=torch.float32)
                )
            else:
                blocks = _blocks(columns, b0)
                offset = 0 if role == "gate" else -(-self.width // b0)
                rows = self.w13_scale_inv.data[expert].narrow(0, offset, len(blocks))
                rows.copy_(tensor.read(rows=blocks, dtype=torch.float32))
