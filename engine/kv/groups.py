"""Layers of one kind form a KV group: each group has a block table of its own per sequence, and
every group draws its blocks from the one pool and its one free list.

A block id names one page in each of the pool's slots (`KVPool` is [slots, planes, blocks, ...]);
a group's layers are those slots, so a block of a group holds that many layers' pages. Groups of
equal size keep every page in use: a kind with more layers than another is split into several
groups, each of the smallest kind's size (the last may be shorter, and leaves slots unused in
its blocks). A model whose layers are all of one kind is one group whose slots are its layers,
as before groups existed. Group 0 is full attention where the model has any."""

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
    slot_of: tuple[int, ...]  # by layer: its index among its group's layers

    @classmethod
    def for_layers(cls, kinds: Sequence[LayerKind]) -> KVGroups:
        if not kinds:
            raise ValueError("a model has at least one attention layer")
        by_kind: dict[LayerKind, list[int]] = {}
        for layer, kind in enumerate(kinds):
            by_kind.setdefault(kind, []).append(layer)
        order = sorted(by_kind, key=lambda k: (not isinstance(k, FullAttention), by_kind[k][0]))
        size = min(len(layers) for layers in by_kind.values())
        groups = [
            KVGroup(kind, tuple(by_kind[kind][i : i + size]))
            for kind in order
            for i in range(0, len(by_kind[kind]), size)
        ]
        group_of = [0] * len(kinds)
        slot_of = [0] * len(kinds)
        for index, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                group_of[layer], slot_of[layer] = index, slot
        return cls(tuple(groups), tuple(group_of), tuple(slot_of))

    @classmethod
    def uniform(cls, num_layers: int) -> KVGroups:
        """Every layer full attention: one group, a slot per layer."""
        return cls.for_layers([FullAttention()] * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Pages a block holds: the largest group's layers."""
        return max(len(g.layers) for g in self.groups)

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

    def slots_done_after(self, layer: int) -> int:
        """How many leading slots hold every group's pages once layers 0..layer have written
        theirs (what layer-wise streaming may send): layer + 1 for a model of one group."""
        done = 0
        for slot in range(self.num_slots):
            last = max(g.layers[slot] for g in self.groups if slot < len(g.layers))
            if last > layer:
                break
            done = slot + 1
        return done


@cache
def groups_for(num_layers: int, layer_kinds: tuple[str, ...]) -> KVGroups:
    """The groups of a model's layers from their kinds' labels (none: every layer full)."""
    if not layer_kinds:
        return KVGroups.uniform(num_layers)
    if len(layer_kinds) != num_layers:
        raise ValueError(f"{len(layer_kinds)} layer kinds for {num_layers} layers")
    return KVGroups.for_layers([parse_kind(k) for k in layer_kinds])
