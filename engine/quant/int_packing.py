"""Packing small unsigned integers (4 or 8 bits) into int32 words along one dimension, in a
given order of the values inside each word: the storage of AWQ's and GPTQ's weights and zero
points, both ways, in plain torch."""

from __future__ import annotations

import torch

SEQUENTIAL_4 = (0, 1, 2, 3, 4, 5, 6, 7)
# AutoAWQ's GEMM layout: word nibble i (bits 4i..4i+3) holds value AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def per_word(bits: int) -> int:
    """How many `bits`-wide values one int32 word holds."""
    if bits not in (4, 8):
        raise ValueError(f"packing {bits}-bit values is not supported (4 or 8)")
    return 32 // bits


def pack(
    values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int32 words of the integers `values` (each in [0, 2**bits)), `32 // bits` consecutive
    values along `dim` per word; word slot i (its bits i*bits and up) holds value `order[i]` of
    its run (sequential when None)."""
    k = per_word(bits)
    order = order or tuple(range(k))
    if values.min() < 0 or values.max() >= 2**bits:
        raise ValueError(f"values outside [0, {2**bits}) cannot be packed in {bits} bits")
    moved = values.movedim(dim, -1).to(torch.int64)
    n = moved.shape[-1]
    if n % k:
        raise ValueError(f"{n} values along dim {dim} are not whole words of {k}")
    runs = moved.reshape(*moved.shape[:-1], n // k, k)[..., list(order)]
    shifts = torch.arange(k, dtype=torch.int64) * bits
    words = (runs << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same bits, as int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack(
    words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The integers packed by `pack(values, bits, dim, order)` (int32, each in [0, 2**bits)),
    `32 // bits` times as many along `dim` as `words`."""
    k = per_word(bits)
    order = order or tuple(range(k))
    moved = words.movedim(dim, -1)
    # Value j of a run sits in slot order.index(j): shift each value's own slot down.
    slots = [order.index(j) for j in range(k)]
    shifts = torch.tensor(slots, dtype=torch.int32, device=words.device) * bits
    values = (moved.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return values.reshape(*moved.shape[:-1], -1).movedim(-1, dim)
