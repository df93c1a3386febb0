"""The base of every mixture of experts' stack whose weights stay quantized in memory: an expert's
matrices are dequantized into the activations' dtype only when a step routes tokens to it, and the
stack reads its checkpoint tensors itself, an expert's projection at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

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
