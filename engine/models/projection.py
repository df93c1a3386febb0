"""The layer of one checkpoint projection (or of several fused): the quantized layer of the
checkpoint's scheme where it quantizes the projection, else a plain linear layer. Every family's
attention and MLP build their projections through it."""

from __future__ import annotations

from torch import nn

from pdserve.engine.cpu.linear import Linear
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.parallel_layers import RowParallelLinear


def projection(
    cfg: ModelConfig,
    names: list[str],
    in_features: int,
    out_parts: tuple[int, ...],
    bias: bool,
    group: TPGroup | None = None,
    row_parallel: bool = False,
) -> nn.Module:
    """The layer of one projection (or of several fused, `names` their checkpoint modules and
    `out_parts` their rows): the scheme's quantized layer where the checkpoint quantizes it,
    else a plain linear layer
    (row-parallel: its input split across the ranks of `group`)."""
    scheme = cfg.quantization
    quantized = [scheme is not None and scheme.quantizes(name) for name in names]
    if any(quantized) and not all(quantized):
        raise ValueError(
            "config.json field 'quantization_config.modules_to_not_convert' keeps some of "
            f"{', '.join(names)} unquantized but not all: pdserve fuses them into one layer"
        )
    if all(quantized) and scheme is not None:
        return scheme.linear(in_features, out_parts, bias, group if row_parallel else None)
    if row_parallel:
        return RowParallelLinear(in_features, sum(out_parts), bias, group)
    return Linear(in_features, sum(out_parts), bias=bias)
