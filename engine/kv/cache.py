"""The paged KV pool of one node: one preallocated tensor holding every layer's K and V pages.

Layout: [slots, planes, num_blocks, block_size, num_kv_heads, head_dim], so one slot's pages are
contiguous (layer-by-layer transfer) and `pool.layer(l)` gives layer l's caches: (K, V) with two
planes, or (latent,) with one, as multi-head latent attention keeps a single "head" of width
kv_lora_rank + qk_rope_head_dim per token and no separate value. A model whose layers are all
full attention has a slot per layer; one that mixes layer kinds has a slot per layer of its
largest KV group (`pdserve.engine.kv.groups`), each group's blocks holding its layers' pages.

Where layers' pages differ in shape (`layer_shapes`: Gemma 4's full and sliding layers), the
pool's heads and head_dim are the largest layer's, and a smaller layer's pages are a lane of its
slot's (`KVPool.layer_pages`): a contiguous [num_blocks * lanes, block_size, heads, head_dim]
view whose page b * lanes + lane is the layer's part of block b. Transfers move whole slots, so
they move lanes with them; they cannot cut such pages by heads, so nodes of unequal
tensor-parallel sizes cannot exchange them.

An FP8 cache (dtype `fp8_e4m3`, `--kv-cache-dtype fp8`) keeps its pages as bytes, each (token,
KV head) row its head_dim FP8 values then their float32 scale (`pdserve.kernels.kv_fp8_ref`):
the pool's last dimension is `page_width`, head_dim + 4, so a page never moves without its
scales, and cutting pages by heads still cuts byte ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv.groups import KVGroups, groups_for
from pdserve.engine.models.config import ModelConfig
from pdserve.kernels.kv_fp8_ref import FP8_KV_DTYPE, row_width


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two nodes must agree on to exchange pages."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "fp8_e4m3" (FP8 values and their scales)
    planes: int = 2  # K and V; 1: MLA's latent alone
    # Each layer's kind ("full", "sliding 128", "chunked 8192"); empty: every layer full.
    layer_kinds: tuple[str, ...] = ()
    # Each layer's (KV heads, head_dim) in this pool where layers differ (empty: every layer's
    # are num_kv_heads and head_dim, which are then the largest layer's).
    layer_shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.is_fp8 and self.layer_shapes:
            raise ValueError(
                "kv_cache_dtype fp8: layers of unequal KV page shapes share their pages in lanes, "
                "which FP8 pages do not have; use kv_cache_dtype auto"
            )
        if self.layer_shapes:
            largest = max(heads * dim for heads, dim in self.layer_shapes)
            if len(self.layer_shapes) != self.num_layers or not self.layer_kinds:
                raise ValueError("a layout of layers' shapes names each layer's shape and kind")
            if largest != self.num_kv_heads * self.head_dim:
                raise ValueError(
                    f"a slot's page ({self.num_kv_heads} heads x {self.head_dim}) must be the "
                    f"largest layer's ({largest} per token)"
                )

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        block_size: int,
        dtype: str,
        num_kv_heads: int | None = None,
        heads_of: Callable[[int], int] | None = None,
    ) -> KVLayout:
        """The layout of a model's cache: of the layers that keep their own KV (not those that
        read an earlier layer's, `ModelConfig.kv_donors`). num_kv_heads: a tensor-parallel
        rank's share of the KV heads; heads_of(n): its share of a layer's n, where layers'
        counts differ."""
        if dtype == FP8_KV_DTYPE:
            check_fp8_cache(cfg)
        n = cfg.num_cache_layers
        kinds = cfg.layer_kinds[:n]
        if not cfg.has_mixed_kv_shapes:
            heads = cfg.cache_heads if num_kv_heads is None else num_kv_heads
            kinds = kinds if any(k != "full" for k in kinds) else ()
            return cls(n, block_size, heads, cfg.cache_head_dim, dtype, cfg.cache_planes, kinds)
        heads_of = heads_of or (lambda heads: heads)
        shapes = tuple((heads_of(cfg.layer_kv_heads[i]), cfg.layer_head_dims[i]) for i in range(n))
        heads, head_dim = max(shapes, key=lambda shape: shape[0] * shape[1])
        kinds = kinds or ("full",) * n
        return cls(n, block_size, heads, head_dim, dtype, cfg.cache_planes, kinds, shapes)

    @property
    def groups(self) -> KVGroups:
        """The layers' KV groups: one, of every layer, unless the model mixes layer kinds or
        page shapes."""
        sizes = tuple(heads * dim for heads, dim in self.layer_shapes)
        return groups_for(self.num_layers, self.layer_kinds, sizes)

    @property
    def num_slots(self) -> int:
        """Pages one block holds: a layer's each, or the largest group's layers'."""
        return self.groups.num_slots if self.layer_kinds else self.num_layers

    @property
    def is_fp8(self) -> bool:
        """Pages of FP8 values with a scale per (token, KV head) row."""
        return self.dtype == FP8_KV_DTYPE

    @property
    def torch_dtype(self) -> torch.dtype:
        """The pages' element type as stored: bytes (uint8) for an FP8 cache."""
        return torch.uint8 if self.is_fp8 else getattr(torch, self.dtype)

    @property
    def page_width(self) -> int:
        """Elements of one (token, KV head) row as stored: head_dim, or with FP8 its bytes and
        its scale's."""
        return row_width(self.head_dim) if self.is_fp8 else self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers and planes."""
        elem = torch.tensor([], dtype=self.torch_dtype).element_size()
        return (
            self.num_slots
            * self.planes
            * self.block_size
            * self.num_kv_heads
            * self.page_width
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
            **({"layer_shapes": [list(s) for s in self.layer_shapes]} if self.layer_shapes else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "layer_kinds" in fields:
            fields["layer_kinds"] = tuple(fields["layer_kinds"])
        if "layer_shapes" in fields:
            fields["layer_shapes"] = tuple(tuple(s) for s in fields["layer_shapes"])
        return cls(**fields)

    def check_compatible(self, other: KVLayout, ignore: tuple[str, ...] = ()) -> None:
        """Raise ValueError naming the first field (not in `ignore`) where two layouts differ.
        Tensor-parallel ranks exchange pages of layouts that differ in num_kv_heads alone."""
        for name in self.__dataclass_fields__:
            if name in ignore:
                continue
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine == theirs:
                continue
            if name == "layer_shapes" and "num_kv_heads" in ignore:
                raise ValueError(
                    "KV layout mismatch in field 'layer_shapes': pages of layers of unequal "
                    "shapes move whole, between pools of the same heads (nodes of equal "
                    f"tensor-parallel sizes): {mine!r} != {theirs!r}"
                )
            raise ValueError(f"KV layout mismatch in field '{name}': {mine!r} != {theirs!r}")


def check_fp8_cache(cfg: ModelConfig) -> None:
    """Refuse an FP8 cache for the models whose pages hold more than attention's K and V rows
    (or MLA's latent rows): linear attention's state, and pages of unequal shapes in lanes."""
    what = None
    if cfg.linear_attention is not None:
        what = "linear attention's state, kept in the same pages as the attention KV,"
    elif cfg.has_mixed_kv_shapes:
        what = "layers of unequal KV page shapes (pages in lanes)"
    if what is not None:
        raise ValueError(
            f"kv_cache_dtype fp8: {cfg.model_type}'s {what} cannot be stored in FP8 pages; "
            "use kv_cache_dtype auto"
        )


def model_groups(cfg: ModelConfig) -> KVGroups:
    """The KV groups of a model's layers that keep KV, as every node's and rank's pool has them:
    they depend on the layers' kinds and their pages' relative sizes, not on the heads a rank
    holds or the block size."""
    return KVLayout.for_model(cfg, block_size=1, dtype="float32").groups


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
        self._lanes = layout.groups if layout.layer_shapes else None
        shape = (
            layout.num_slots,
            layout.planes,
            num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.page_width,
        )
        if kv is None:
            kv = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        elif tuple(kv.shape) != shape or kv.dtype != layout.torch_dtype:
            raise ValueError(f"KV tensor {tuple(kv.shape)} {kv.dtype} does not match {shape}")
        self.kv = kv

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """(K, V) pages of one layer, or (latent,) with one plane; of a layout with lanes, the
        layer's lane views (see `layer_pages`)."""
        if self._lanes is not None:
            return self.layer_pages(index).planes
        return layer_planes(self.kv, index if self._slot_of is None else self._slot_of[index])

    def layer_pages(self, index: int) -> LayerPages:
        """One layer's pages as the kernels read them, and where its blocks' pages are."""
        if self._lanes is None:
            return LayerPages(self.layer(index), 1, 0, self.layout.block_size)
        groups = self._lanes
        lanes, slot = groups.lanes_of[index], groups.slot_of[index]
        heads, head_dim = self.layout.layer_shapes[index]
        shape = (self.num_blocks * lanes, self.layout.block_size, heads, head_dim)
        planes = tuple(self.kv[slot, p].view(shape) for p in range(self.layout.planes))
        return LayerPages(planes, lanes, groups.lane_of[index], self.layout.block_size)

    @staticmethod
    def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return max(0, budget_bytes // layout.bytes_per_block)


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One layer's pages, a tensor per plane: (K, V) or (latent,), each [pages, block_size,
    heads, head_dim]. With lanes > 1 its slot holds `lanes` such pages per block, and block b's
    is page b * lanes + lane: `slots` and `tables` turn a group's slot mapping and block tables
    into this layer's. A padding token's slot and a given-back block (-1) stay below zero (floor
    division: -1 maps to lane - lanes), so the kernels skip them as before."""

    planes: tuple[torch.Tensor, ...]
    lanes: int
    lane: int
    block_size: int

    def slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        if self.lanes == 1:
            return slot_mapping
        bs = self.block_size
        return (slot_mapping // bs * self.lanes + self.lane) * bs + slot_mapping % bs

    def tables(self, block_tables: torch.Tensor) -> torch.Tensor:
        if self.lanes == 1:
            return block_tables
        return block_tables * self.lanes + self.lane


def layer_planes(kv: torch.Tensor, index: int) -> tuple[torch.Tensor, ...]:
    """Layer `index`'s pages of a pool tensor, a tensor per plane: (K, V), or (latent,)."""
    if kv.shape[1] == 1:
        return (kv[index, 0],)
    return kv[index, 0], kv[index, 1]
