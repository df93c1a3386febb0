"""Layers of one kind form a KV group: each group has a block table of its own per sequence, and
every group draws its blocks from the one pool and its one free list.

A block id names one page in each of the pool's slots (`KVPool` is [slots, planes, blocks, ...]);
a group's layers are laid in those slots, so a block of a group holds that many layers' pages.
Groups of equal size keep every page in use: a kind with more layers than another is split into
several groups, each of the smallest kind's size (the last may be shorter, and leaves slots
unused in its blocks). A model whose layers are all of one kind is one group whose slots are its
layers, as before groups existed. Group 0 is full attention where the model has any.

Layers whose pages differ in size (Gemma 4: 512-wide heads on its full layers, 256-wide on its
sliding ones, and other KV head counts) share the pool by **lanes**: a slot's page is as big as
the largest layer's, and a layer whose page is 1/n of that takes one of its n lanes, so n such
layers fill one slot. Layers of another size form groups of their own (a group's layers are
alike in kind and page size), and every group is cut to fill the same number of slots (the
smallest kind's slot count, as above), so a block's bytes serve any group: Gemma 4 31B's ten full
layers (4 heads x 512, two to a slot) fill 5 slots, as do its sliding groups of 5 layers (16 heads
x 256); no byte of a block is idle. Where counts do not divide, the last group of a kind leaves
lanes or slots unused (`fill`). A layer's lane is a contiguous view of its slot's pages with
n times the block count, in which block b of the pool is page b * n + lane (`KVPool.layer_pages`),
so the attention kernels read ordinary contiguous pages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from pdserve.engine.kv.layer_kinds import FullAttention, LayerKind, parse_kind


@dataclass(frozen=True, slots=True)
class KVGroup:
    kind: LayerKind
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    group_of: tuple[int, ...]  # by layer
    slot_of: tuple[int, ...]  # by layer: the slot its pages are in
    # By layer: how many pages of its size a slot's page holds, and which of them is its own
    # (all 1 and 0 where every layer's page is alike).
    lanes_of: tuple[int, ...] = ()
    lane_of: tuple[int, ...] = ()

    @classmethod
    def for_layers(
        cls, kinds: Sequence[LayerKind], page_sizes: Sequence[int] | None = None
    ) -> KVGroups:
        """The groups of layers of these kinds; page_sizes: each layer's page size (any unit,
        e.g. K heads x head_dim), where they differ (none: all alike). Every size must divide
        the largest."""
        if not kinds:
            raise ValueError("a model has at least one attention layer")
        sizes = list(page_sizes) if page_sizes else [1] * len(kinds)
        if len(sizes) != len(kinds):
            raise ValueError(f"{len(sizes)} page sizes for {len(kinds)} layers")
        largest = max(sizes)
        if any(size <= 0 or largest % size for size in sizes):
            raise ValueError(f"layers' page sizes {sorted(set(sizes))} do not divide the largest")
        by_spec: dict[tuple[LayerKind, int], list[int]] = {}
        for layer, spec in enumerate(zip(kinds, sizes)):
            by_spec.setdefault(spec, []).append(layer)
        order = sorted(by_spec, key=lambda s: (not isinstance(s[0], FullAttention), by_spec[s][0]))
        lanes = {spec: largest // spec[1] for spec in by_spec}
        # Slots a group fills: what the smallest kind's layers take, all in one group.
        slots = min(-(-len(layers) // lanes[spec]) for spec, layers in by_spec.items())
        groups = []
        for spec in order:
            layers, per_group = by_spec[spec], slots * lanes[spec]
            groups += [
                KVGroup(spec[0], tuple(layers[i : i + per_group]))
                for i in range(0, len(layers), per_group)
            ]
        n = len(kinds)
        group_of, slot_of, lanes_of, lane_of = [0] * n, [0] * n, [1] * n, [0] * n
        for index, group in enumerate(groups):
            for position, layer in enumerate(group.layers):
                count = largest // sizes[layer]
                group_of[layer], lanes_of[layer] = index, count
                slot_of[layer], lane_of[layer] = divmod(position, count)
        return cls(tuple(groups), tuple(group_of), tuple(slot_of), tuple(lanes_of), tuple(lane_of))

    @classmethod
    def uniform(cls, num_layers: int) -> KVGroups:
        """Every layer full attention: one group, a slot per layer."""
        return cls.for_layers([FullAttention()] * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Pages a block holds: the most slots a group's layers take."""
        return max(self.slot_of) + 1

    @property
    def num_layers(self) -> int:
        return len(self.group_of)

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's kind, by layer."""
        return tuple(self.groups[g].kind for g in self.group_of)

    @property
    def is_uniform(self) -> bool:
        return self.num_groups == 1

    def blocks_read(self, num_tokens: int, block_size: int) -> int:
        """The blocks of a sequence's first num_tokens that the query after them reads, in every
        group: what a handoff of them moves, and what they hold on a decode node (a full group's
        every block; a windowed or chunked group's from the first its next query reads)."""
        whole = -(-num_tokens // block_size)
        return sum(
            whole - min(whole, g.kind.first_read(num_tokens) // block_size) for g in self.groups
        )

    @property
    def has_lanes(self) -> bool:
        """Whether some layer's page is a lane of a larger slot page."""
        return any(count > 1 for count in self.lanes_of)

    def fill(self, group: int) -> float:
        """The share of a block's bytes that group's pages use (1.0: none idle)."""
        used = sum(1 / self.lanes_of[layer] for layer in self.groups[group].layers)
        return used / self.num_slots

    def slots_done_after(self, layer: int) -> int:
        """How many leading slots hold every group's pages once layers 0..layer have written
        theirs (what layer-wise streaming may send): layer + 1 for a model of one group."""
        last_in_slot = [-1] * self.num_slots
        for index, slot in enumerate(self.slot_of):
            last_in_slot[slot] = max(last_in_slot[slot], index)
        done = 0
        for last in last_in_slot:
            if last > layer:
                break
            done += 1
        return done


@cache
def groups_for(
    num_layers: int, layer_kinds: tuple[str, ...], page_sizes: tuple[int, ...] = ()
) -> KVGroups:
    """The groups of a model's layers from their kinds' labels (none: every layer full) and,
    where they differ, their pages' sizes."""
    if not layer_kinds:
        return KVGroups.uniform(num_layers)
    if len(layer_kinds) != num_layers:
        raise ValueError(f"{len(layer_kinds)} layer kinds for {num_layers} layers")
    return KVGroups.for_layers([parse_kind(k) for k in layer_kinds], page_sizes or None)
