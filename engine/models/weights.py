"""Reading checkpoint tensors from `*.safetensors`, one file or sharded with an index.

A tensor is read lazily: `CheckpointTensor.read(rows=..., columns=...)` reads only that slice
from the file (safetensors' `get_slice`), so a tensor-parallel rank never materialises the
parts of a weight it does not own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} named in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


class CheckpointTensor:
    """One tensor of an open checkpoint file, not read yet."""

    def __init__(self, handle, name: str, dtype: torch.dtype) -> None:  # noqa: ANN001
        self._slice = handle.get_slice(name)
        self.name = name
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    @property
    def stored_dtype(self) -> str:
        """The dtype in the file, as safetensors names it (F32, BF16, F8_E4M3)."""
        return self._slice.get_dtype()

    def read(
        self,
        rows: range | None = None,
        columns: range | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The tensor, or only its rows (dim 0) / columns (dim 1) in these ranges, cast (to
        `dtype` where given, else to the model's)."""
        if rows is None and columns is None:
            tensor = self._slice[:]
        elif columns is None:
            tensor = self._slice[rows.start : rows.stop]
        else:
            rows = rows or range(self.shape[0])
            tensor = self._slice[rows.start : rows.stop, columns.start : columns.stop]
        return tensor.to(dtype or self.dtype)

    def read_along(self, dim: int, part: range) -> torch.Tensor:
        """The tensor's slices `part` along dimension `dim` (every index of the others), cast
        to the model's dtype: a rank's columns of a stacked [experts, ...] weight."""
        index = tuple(
            slice(part.start, part.stop) if d == dim else slice(None)
            for d in range(len(self.shape))
        )
        return self._slice[index].to(self.dtype)

    def read_slices(self, *index: int | range, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor at one index (an int) or range per leading dimension, cast (to `dtype`
        where given, else to the model's): one expert's rows of a stacked experts tensor."""
        key = tuple(i if isinstance(i, int) else slice(i.start, i.stop) for i in index)
        return self._slice[key].to(dtype or self.dtype)


def iter_checkpoint(model_dir: str | Path, dtype: torch.dtype) -> Iterator[CheckpointTensor]:
    """Every tensor of every shard, unread, in file order."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield CheckpointTensor(f, name, dtype)
