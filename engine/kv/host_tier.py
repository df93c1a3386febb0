"""The host-memory KV tier under a node's prefix cache: full blocks' pages kept in one
preallocated buffer of slots (pinned where the pool is on a GPU), keyed by the block's chained
hash, evicted least recently used.

Bookkeeping only, as `BlockManager` is for the device pool: `pdserve.engine.kv.tiers` copies the
bytes. A slot is reserved before its copy starts and committed when the copy completed; only
committed slots are found by `lookup`, so a block is never served from a copy that did not
finish. A pinned slot (a copy reading it is in flight) is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.events import KVEvents

BlockKey = tuple[int | None, tuple[int, ...]]


class HostTier:
    TIER = "host"

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        pin_memory: bool = False,
        events: KVEvents | None = None,
    ) -> None:
        self.layout = layout
        self.num_slots = capacity_bytes // layout.bytes_per_block
        if self.num_slots <= 0:
            raise ValueError(
                f"a host KV tier of {capacity_bytes} bytes holds no block of "
                f"{layout.bytes_per_block} bytes"
            )
        # One slot is one pool block (a page of every pool slot and plane), contiguous:
        # [slot, pool slot, plane, ...]; a pool slot is a layer unless the layers form groups.
        shape = (
            self.num_slots,
            layout.num_slots,
            layout.planes,
            layout.block_size,
            layout.num_kv_heads,
            layout.page_width,
        )
        self.buffer = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin_memory)
        self.events = events
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._slot: OrderedDict[int, int] = OrderedDict()  # committed: hash -> slot, LRU first
        self._key: dict[int, BlockKey] = {}  # committed slot -> what it holds
        self._pending: dict[int, int] = {}  # hash -> slot whose copy is in flight
        self._pins: dict[int, int] = {}  # slot -> copies reading it

    @property
    def num_blocks(self) -> int:
        """Committed blocks: what lookups can find."""
        return len(self._slot)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.bytes_per_block

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        """The committed slot holding this block (now the most recently used), or None. The key
        is compared too, so a hash collision never serves another prompt's pages."""
        slot = self._slot.get(block_hash)
        if slot is None or self._key[slot] != key:
            return None
        self._slot.move_to_end(block_hash)
        return slot

    def serves(self, block_hash: int, key: BlockKey) -> bool:
        """Whether lookup would find this block, without making it the most recently used."""
        slot = self._slot.get(block_hash)
        return slot is not None and self._key[slot] == key

    def holds(self, block_hash: int) -> bool:
        """Committed or on its way in: no second copy is needed."""
        return block_hash in self._slot or block_hash in self._pending

    def reserve(self, block_hash: int) -> int | None:
        """A slot for a block about to be copied in (one it does not hold): a free one, else the
        least recently used committed one that no copy reads. None when every slot is in flight
        or pinned (the copy is skipped: a full tier never makes the step loop wait)."""
        if self.holds(block_hash):
            raise ValueError(f"block {block_hash:032x} is already in the host tier")
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._evict_one()
            if slot is None:
                return None
        self._pending[block_hash] = slot
        return slot

    def commit(self, block_hash: int, key: BlockKey) -> None:
        """The copy into the block's reserved slot completed: lookups find it from now on."""
        slot = self._pending.pop(block_hash)
        self._slot[block_hash] = slot
        self._key[slot] = key
        if self.events is not None:
            self.events.stored(self.TIER, block_hash)

    def abandon(self, block_hash: int) -> None:
        """The copy into the block's reserved slot failed: the slot is free again."""
        self._free.append(self._pending.pop(block_hash))

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
        else:
            del self._pins[slot]

    def clear(self) -> None:
        """Forget every committed block no copy reads: their slots are free again."""
        for block_hash, slot in list(self._slot.items()):
            if slot not in self._pins:
                del self._slot[block_hash]
                del self._key[slot]
                self._free.append(slot)
                if self.events is not None:
                    self.events.removed(self.TIER, block_hash)

    def hashes(self) -> list[int]:
        """Every committed block's hash, least recently used first."""
        return list(self._slot)

    def _evict_one(self) -> int | None:
        for block_hash, slot in self._slot.items():
            if slot not in self._pins:
                del self._slot[block_hash]
                del self._key[slot]
                if self.events is not None:
                    self.events.removed(self.TIER, block_hash)
                return slot
        return None
