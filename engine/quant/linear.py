"""The base of every layer whose weight stays quantized in memory: on a CPU it is dequantized
into the activations' dtype on every call (nothing dequantized is kept between calls: the memory
is the point), on a GPU a format's `matmul` may run a kernel that reads it as stored; it reads
its checkpoint tensors itself, in the logical [out, in] terms the models split by, whatever the
format's packing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from pdserve.engine.models.weights import CheckpointTensor


class RankGroup(Protocol):
    """What a row-parallel quantized layer asks of its tensor-parallel group
    (`engine.tp.group.TPGroup`, which imports the models' config and so cannot be imported here):
    how many ranks it spans, and the sum of a tensor across them."""

    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


class QuantLinear(nn.Module):
    """Subclasses set `in_features`, `out_parts`, `out_features`, `group` and `bias` and
    implement `dequantized` and `load`; `kinds` names the checkpoint tensors `load` reads."""

    kinds: tuple[str, ...] = ()
    in_features: int
    out_parts: tuple[int, ...]
    out_features: int
    group: RankGroup | None
    bias: nn.Parameter | None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` (the format's reference dequantization)."""
        raise NotImplementedError

    def load(
        self, kind: str, tensor: CheckpointTensor, dim: int, part: range, size: int, offset: int
    ) -> None:
        """Read this rank's `part` (of `size`, along the logical `dim`: 0 output rows, 1 input
        columns) of one checkpoint tensor (`kind`, one of `kinds`) into place; a fused part's
        rows go at output row `offset`."""
        raise NotImplementedError

    def loaded(self) -> None:
        """Called once every checkpoint tensor of the layer is read: a layer that keeps another
        layout for its device's GEMM converts here. Nothing by default."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight^T (+ bias): the reference dequantizes per call; a format with a GPU kernel
        overrides this to run it where it can."""
        return F.linear(x, self.dequantized(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.matmul(x, self.bias)
        y = self.group.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
