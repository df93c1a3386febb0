"""The paged KV pool of one node: one preallocated tensor holding every layer's K and V pages.

Layout: [slots, planes, num_blocks, block_size, num_kv_heads, head_dim], so one slot's pages are
contiguous (layer-by-layer transfer) and `pool.layer(l)` gives layer l's caches: (K, V) with two
planes, or (latent,) with one, as multi-head latent attention keeps a single "head" of width
kv_lora_rank + qk_rope_head_dim per token and no separate value. A model whose layers are all
full attention has a slot per layer; one that mixes layer kinds has a slot per layer of its
largest KV group (`pdserve.engine.kv.groups`), each group's blocks holding its layers' pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kv.groups import KVGroups, groups_for
from pdserve.engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two nodes must agree on to exchange pages."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    planes: int = 2  # K and V; 1: MLA's latent alone
    # Each layer's kind ("full", "sliding 128", "chunked 8192"); empty: every layer full.
    layer_kinds: tuple[str, ...] = ()

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, block_size: int, dtype: str, num_kv_heads: int | None = None
    ) -> KVLayout:
        """The layout of a model's cache (num_kv_heads: a tensor-parallel rank's share)."""
        heads = cfg.cache_heads if num_kv_heads is None else num_kv_heads
        kinds = cfg.layer_kinds if any(k != "full" for k in cfg.layer_kinds) else ()
        return cls(
            cfg.num_layers, block_size, heads, cfg.cache_head_dim, dtype, cfg.cache_planes, kinds
        )

    @property
    def groups(self) -> KVGroups:
        """The layers' KV groups: one, of every layer, unless the model mixes layer kinds."""
        return groups_for(self.num_layers, self.layer_kinds)

    @property
    def num_slots(self) -> int:
        """Pages one block holds: a layer's each, or the largest group's layers'."""
        return self.groups.num_slots if self.layer_kinds else self.num_layers

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers and planes."""
        elem = torch.tensor([], dtype=self.torch_dtype).element_size()
        return (
            self.num_slots
            * self.planes
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * elem
        )

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "planes": self.planes,
            **({"layer_kinds": list(self.layer_kinds)} if self.layer_kinds else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "layer_kinds" in fields:
            fields["layer_kinds"] = tuple(fields["layer_kinds"])
        return cls(**fields)

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
        self._slot_of = layout.groups.slot_of if layout.layer_kinds else None
        shape = (
            layout.num_slots,
            layout.planes,
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

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """(K, V) pages of one layer, or (latent,) with one plane."""
        return layer_planes(self.kv, index if self._slot_of is None else self._slot_of[index])

    @staticmethod
    def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return max(0, budget_bytes // layout.bytes_per_block)


def layer_planes(kv: torch.Tensor, index: int) -> tuple[torch.Tensor, ...]:
    """Layer `index`'s pages of a pool tensor, a tensor per plane: (K, V), or (latent,)."""
    if kv.shape[1] == 1:
        return (kv[index, 0],)
    return kv[index, 0], kv[index, 1]
