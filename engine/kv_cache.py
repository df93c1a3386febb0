"""The paged KV pool of one node: one preallocated tensor holding every layer's K and V pages.

Layout: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], so one layer's
pages are contiguous (layer-by-layer transfer) and `pool.layer(l)` gives the (K, V) caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two nodes must agree on to exchange pages."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.tensor([], dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def check_compatible(self, other: KVLayout, ignore: tuple[str, ...] = ()) -> None:
        """Raise ValueError naming the first field (not in `ignore`) where two layouts differ.
        Tensor-parallel ranks exchange pages of layouts that differ in num_kv_heads alone."""
        for name in self.__dataclass_fields__:
            if name in ignore:
                continue
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise ValueError(f"KV layout mismatch in field '{name}': {mine!r} != {theirs!r}")


class KVPool:
    """The preallocated page pool. `kv` may be given (e.g. a shared-memory tensor)."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        kv: torch.Tensor | None = None,
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (
            layout.num_layers,
            2,
            num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        if kv is None:
            kv = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        elif tuple(kv.shape) != shape or kv.dtype != layout.torch_dtype:
            raise ValueError(f"KV tensor {tuple(kv.shape)} {kv.dtype} does not match {shape}")
        self.kv = kv

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[index, 0], self.kv[index, 1]

    @staticmethod
    def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return max(0, budget_bytes // layout.bytes_per_block)
