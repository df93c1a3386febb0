"""Bookkeeping of the paged KV pool: which physical blocks each sequence holds, and prefix caching.

Pure Python: it hands out block ids; the model runner and the transports move the bytes. Full
blocks are keyed by a hash chained over (parent hash, token ids) (`pdserve.cluster.block_hash`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence

from pdserve.cluster.block_hash import hash_block_tokens
from pdserve.engine.kv.events import KVEvents

BlockKey = tuple[int | None, tuple[int, ...]]  # (parent block's hash, this block's token ids)


class BlockManager:
    """Reference-counted blocks with a free list and an LRU set of cached, unreferenced blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEvents | None = None,
    ) -> None:
        """events: where blocks entering and leaving the prefix cache are logged (the node's
        KV events), if anywhere."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_hits = 0
        self.prefix_misses = 0
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, not in the prefix cache
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; oldest first
        self._cached: dict[int, int] = {}  # hash -> the one block registered under it
        self._key: dict[int, BlockKey] = {}  # registered block -> what it holds, to verify hits
        # Every full block hashed so far, registered or a duplicate of a registered one, so that
        # cache_full_blocks never hashes the same block twice.
        self._hash: dict[int, int] = {}
        self.events = events
        # Blocks registered since the last `take_newly_cached` (block, hash), when someone takes
        # them (the tiers below the pool copy each once); None: nobody does.
        self.newly_cached: list[tuple[int, int]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: unreferenced, whether plain free or cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a reference count above zero."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def key(self, block_id: int) -> BlockKey | None:
        """What a registered block holds (parent block's hash, token ids); None if unregistered."""
        return self._key.get(block_id)

    def registered_hash(self, block_id: int) -> int | None:
        """The hash a block is registered under in the prefix cache, or None."""
        h = self._hash.get(block_id)
        return h if h is not None and self._cached.get(h) == block_id else None

    def hold(self, block_table: list[int]) -> None:
        """Take a reference on each block, referenced or cached-evictable (a copy reading it
        to a lower tier; released with `free`)."""
        loose = [b for b in block_table if self._ref[b] <= 0 and not self._is_registered(b)]
        if loose:
            raise ValueError(f"blocks {loose[:4]} are neither referenced nor cached")
        for block in block_table:
            self._take(block)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def blocks_needed(
        self, block_table: list[int], num_tokens: int, num_tokens_held: int | None = None
    ) -> int:
        """New blocks that allocate_slots with the same arguments would take."""
        self._tokens_held(block_table, num_tokens_held)
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def allocate_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Take references on the longest cached chain of full blocks that prefixes token_ids.

        Leaves at least one token uncovered, so the caller always has a token to compute.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        table: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(parent, tokens)
            block = self._cached.get(h)
            # Compare contents too: a hash collision must never hand out another prompt's pages.
            if block is None or self._key[block] != (parent, tokens):
                break
            table.append(block)
            parent = h
        for block in table:
            self._take(block)
        self.prefix_hits += len(table)
        # Blocks after the first miss are not looked up but must be computed: they count as misses.
        self.prefix_misses += max_blocks - len(table)
        return table

    def allocate_slots(
        self, block_table: list[int], num_tokens: int, num_tokens_held: int | None = None
    ) -> bool:
        """Grow block_table in place to hold num_tokens: True if it did, False (and no change)
        if blocks run out."""
        if not self.can_allocate(self.blocks_needed(block_table, num_tokens, num_tokens_held)):
            return False
        while len(block_table) * self.block_size < num_tokens:
            block_table.append(self._allocate_fresh())
        return True

    def cache_full_blocks(
        self, block_table: list[int], token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Register the blocks of block_table that num_computed_tokens has filled."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = num_computed_tokens // bs
        if num_computed_tokens > len(token_ids) or num_full > len(block_table):
            raise ValueError(
                f"{num_computed_tokens} computed tokens do not fit {len(token_ids)} token ids "
                f"in a table of {len(block_table)} blocks"
            )
        # Hashed blocks always form a prefix of a table, so scan back to the last one: O(1) per
        # decode step instead of O(length).
        start = num_full
        while start > 0 and block_table[start - 1] not in self._hash:
            start -= 1
        parent = self._hash[block_table[start - 1]] if start > 0 else None
        for i in range(start, num_full):
            block = block_table[i]
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(parent, tokens)
            self._hash[block] = h
            # An identical block cached by another sequence keeps its entry: both stay valid.
            if h not in self._cached:
                self._register(block, h, (parent, tokens))
            parent = h

    def allocate_one(self) -> int:
        """One block for new content (the caller checked can_allocate)."""
        return self._allocate_fresh()

    def cached_block(self, h: int, key: BlockKey) -> int | None:
        """The block registered under hash h if it holds key's content (a hash collision must
        never hand out another prompt's pages), else None."""
        block = self._cached.get(h)
        return block if block is not None and self._key[block] == key else None

    def take(self, blocks: list[int]) -> None:
        """Take a reference on each of these registered blocks (a prefix hit)."""
        for block in blocks:
            self._take(block)

    def cache_hashed_blocks(
        self,
        block_table: list[int],
        num_full: int,
        hash_of: Callable[[int], int],
        key_of: Callable[[int], BlockKey],
        keep: Callable[[int], bool] | None = None,
    ) -> None:
        """Register the first num_full blocks of block_table, block i under hash_of(i) holding
        key_of(i) (a KV group's own hashes); -1 entries, blocks the table gave back, are
        skipped, and so are those keep(i) refuses (they go back to the free list, uncached).
        As cache_full_blocks, it scans back only to the last block already hashed."""
        if not self.enable_prefix_caching:
            return
        start = num_full
        while (
            start > 0 and block_table[start - 1] >= 0 and block_table[start - 1] not in self._hash
        ):
            start -= 1
        for i in range(start, num_full):
            if block_table[i] >= 0 and (keep is None or keep(i)):
                self.cache_block(block_table[i], hash_of(i), key_of(i))

    def cache_block(self, block: int, h: int, key: BlockKey) -> None:
        """Register one filled block under hash h, holding key (a block loaded from a tier
        below the pool); where another block is registered under h already, that one stays."""
        self._hash[block] = h
        if h not in self._cached:
            self._register(block, h, key)

    def free(self, block_table: list[int]) -> None:
        """Drop block_table's references, tail first so the LRU evicts tails before heads."""
        # Check everything first so that a double free raises without changing anything.
        for block, count in Counter(block_table).items():
            if count > self._ref[block]:
                raise ValueError(
                    f"double free of block {block}: ref count {self._ref[block]}, "
                    f"freed {count} time(s)"
                )
        for block in reversed(block_table):
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if self._is_registered(block):
                self._evictable[block] = None
            else:
                self._hash.pop(block, None)
                self._free.append(block)
        block_table.clear()

    def share(self, block_table: list[int]) -> None:
        """Take one more reference on each of block_table's blocks, all already referenced (a
        second owner, e.g. a KV send reading them, frees its references with `free`)."""
        unreferenced = [b for b in block_table if self._ref[b] <= 0]
        if unreferenced:
            raise ValueError(f"blocks {unreferenced[:4]} are not referenced: nothing to share")
        for block in block_table:
            self._ref[block] += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody references; referenced ones stay registered."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
            self._free.append(block)

    def _tokens_held(self, block_table: list[int], num_tokens_held: int | None) -> int:
        held = len(block_table) * self.block_size if num_tokens_held is None else num_tokens_held
        # The table must hold exactly the blocks its tokens need, so its last block is where
        # writing resumes.
        if -(-held // self.block_size) != len(block_table):
            raise ValueError(
                f"{held} tokens held do not match a table of {len(block_table)} blocks "
                f"of {self.block_size}"
            )
        return held

    def _is_registered(self, block: int) -> bool:
        h = self._hash.get(block)
        return h is not None and self._cached.get(h) == block

    def _take(self, block: int) -> None:
        """Add a reference to a cached block; an unreferenced one leaves the evictable set."""
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _allocate_fresh(self) -> int:
        """A block for new content: the plain free list first, then the least recently used."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        self._ref[block] = 1
        return block

    def _register(self, block: int, h: int, key: BlockKey) -> None:
        self._cached[h] = block
        self._key[block] = key
        if self.events is not None:
            self.events.stored("device", h)
        if self.newly_cached is not None:
            self.newly_cached.append((block, h))

    def _unregister(self, block: int) -> None:
        h = self._hash.pop(block)
        del self._cached[h]
        del self._key[block]
        if self.events is not None:
            self.events.removed("device", h)
