"""The base of the layers whose weights stay packed into int32 words in memory (AWQ's and
GPTQ's): they keep their checkpoint tensors as stored (packed int32 values and zero points,
float16 scales, int32 group indices) through the model's moves and dtype casts, and check each
tensor's shape and stored dtype as they read it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.quant.linear import QuantLinear

if TYPE_CHECKING:
    from pdserve.engine.models.weights import CheckpointTensor

# The dtype each stored tensor holds, as safetensors names it and as torch keeps it.
STORED = {
    "qweight": ("I32", torch.int32),
    "qzeros": ("I32", torch.int32),
    "g_idx": ("I32", torch.int32),
    "scales": ("F16", torch.float16),
}


class PackedLinear(QuantLinear):
    """Subclasses hold each of `kinds` as a parameter of that name (its dtype per `STORED`)."""

    format_name = "packed"

    def _hold(self, kind: str, shape: tuple[int, ...]) -> None:
        tensor = torch.zeros(shape, dtype=STORED[kind][1])
        setattr(self, kind, nn.Parameter(tensor, requires_grad=False))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # noqa: ANN202
        """Moves (and `to_empty`) reach the packed tensors; dtype casts of the model
        (`model.to(torch.bfloat16)`) do not: they keep their stored dtypes."""
        device = fn(torch.empty(0, device=self.qweight.device)).device
        for name in self.kinds:
            param = getattr(self, name)
            moved = torch.empty_like(param, device=device) if param.is_meta else param.to(device)
            setattr(self, name, nn.Parameter(moved, requires_grad=False))
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.detach()), requires_grad=False)
        return self

    def _read(
        self,
        kind: str,
        tensor: CheckpointTensor,
        full: tuple[int, ...],
        rows: range | None = None,
        columns: range | None = None,
    ) -> torch.Tensor:
        """`rows` / `columns` of the checkpoint tensor `kind`, checked to be `full`-shaped and
        stored in the format's dtype."""
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full} "
                f"({self.format_name} layout)"
            )
        stored, dtype = STORED[kind]
        if tensor.stored_dtype != stored:
            raise ValueError(
                f"weight '{tensor.name}' is stored as {tensor.stored_dtype}; a "
                f"{self.format_name} checkpoint stores it as {stored}"
            )
        return tensor.read(rows=rows, columns=columns, dtype=dtype)

    def _part_at(self, row_offset: int) -> int:
        """The index of the fused part whose output rows start at row_offset."""
        rows = 0
        for i, n in enumerate(self.out_parts):
            if rows == row_offset:
                return i
            rows += n
        raise ValueError(f"no fused part starts at row {row_offset} of {self.out_parts}")


def words(n: int, per_word: int, what: str) -> int:
    """The int32 words that hold `n` packed values, `n` a whole number of them."""
    if n % per_word:
        raise ValueError(f"{what} of {n} is not a multiple of {per_word} (the packed words)")
    return n // per_word


def word_range(part: range, per_word: int) -> range:
    """The words that hold the values `part` (a whole number of words, starting on one)."""
    if part.start % per_word or len(part) % per_word:
        raise ValueError(f"values {part.start}..{part.stop} are not whole words of {per_word}")
    return range(part.start // per_word, part.stop // per_word)
