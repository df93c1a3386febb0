"""The base of every mixture of experts' stack whose weights stay quantized in memory: an expert's
matrices are dequantized into the activations' dtype only when a step routes tokens to it, and the
stack reads its checkpoint tensors itself, an expert's projection at a time. A stack may run a fused
kernel on a GPU instead (`Fp8Experts`), and then says its steps can be captured in CUDA graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.kernels.moe_ref import grouped_experts

if TYPE_CHECKING:
    from pdserve.engine.models.weights import CheckpointTensor


class QuantExperts(nn.Module):
    """Subclasses set `num_experts`, `width` (this rank's columns of each expert) and
    `hidden_size` and implement `run_expert` and `load`; `kinds` names the checkpoint tensors
    `load` reads."""

    kinds: tuple[str, ...] = ()
    num_experts: int
    width: int
    hidden_size: int

    @property
    def eager_only(self) -> str | None:
        """Why a step through these experts cannot be captured in a CUDA graph (one line), or
        None when it can."""
        return "quantized experts are dequantized one routed expert at a time on the host"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token of x [T, hidden] through its k experts `ids` [T, k], summed with the
        router's `weights` [T, k]: every routed expert dequantized and run on its rows (the
        grouping reads the routes on the host)."""
        return grouped_experts(x, weights, ids, self.num_experts, self.hidden_size, self.run_expert)

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s gated MLP on the rows x routed to it."""
        raise NotImplementedError

    def load(
        self,
        kind: str,
        tensor: CheckpointTensor,
        expert: int,
        role: str,
        columns: range,
        full_width: int,
    ) -> None:
        """Read this rank's `columns` (of `full_width`) of one checkpoint tensor (`kind`, one of
        `kinds`) of expert `expert`'s `role` projection (gate, up or down) into place."""
        raise NotImplementedError
