"""A sequence's KV blocks in every layer group: what the scheduler asks of the cache (a prefix
hit, room for new tokens, registering filled blocks, giving back what no query will read).

Every group draws from the one `BlockManager`. A group's table has an entry per block of the
sequence; a block that no future query of the group reads goes back to the pool and its entry
becomes -1 (a sliding window's blocks wholly older than the window, a chunked group's blocks
before the current chunk), so a long sequence holds pages for its full-attention layers only.
Filled blocks of every group are registered in the prefix cache, keyed by the sequence's chain
of block hashes salted with the group; a prefix hit is the longest prefix for which every group
holds what its next query reads. The tiers below the pool extend a hit by the same rule: a block
is held if the pool or a lower tier has it (`find_below`), and the blocks the pool lacks are
loaded into each group's table (`allocate_load`, `cache_loaded`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cluster.block_hash import group_hash, hash_block_tokens
from pdserve.engine.kv.block_manager import BlockKey, BlockManager
from pdserve.engine.kv.groups import KVGroups
from pdserve.engine.kv.layer_kinds import LinearState
from pdserve.engine.sequence import Sequence

FREED = -1  # a table entry whose block went back to the pool


@dataclass(slots=True)
class PrefixLoad:
    """A prefix hit that blocks from a tier below the pool complete: each group's table of the
    hit (the pool's blocks it reads, FREED where a block is loaded or not read), and the blocks to
    load, by position (a load that fails at one has filled every earlier position)."""

    num_cached: int  # blocks of the pool's own hit (allocate_prefix) it extends
    num_blocks: int  # blocks of the hit once loaded
    max_blocks: int  # the most it could have been (the last token stays to compute)
    tables: list[list[int]]
    places: list[tuple[int, int]]  # (position, group) of each block to load
    keys: list[tuple[int, BlockKey]]  # each one's (group's hash, key), as the tiers hold it
    blocks: list[int] = field(default_factory=list)  # the pool blocks they load into

    @property
    def num_groups(self) -> int:
        return len(self.tables)


def live_blocks(tables: list[list[int]]) -> list[int]:
    """Every block a sequence's tables hold, group after group."""
    return [b for table in tables for b in table if b != FREED]


def handoff_blocks(tables: list[list[int]], skip: int) -> list[int]:
    """The blocks a KV handoff moves: each group's blocks from position `skip` on that hold
    pages, group after group. The prefill node lists its own and the decode node its reserved
    ones alike, so the two lists pair up block for block."""
    return [b for table in tables for b in table[skip:] if b != FREED]


class KVCacheManager:
    def __init__(
        self, block_manager: BlockManager, groups: KVGroups, snapshot_interval: int = 1
    ) -> None:
        """snapshot_interval: a linear-attention group's states enter the prefix cache at every
        snapshot_interval-th block boundary only (the blocks between go back uncached): a hit
        then ends on such a boundary, and the cache holds 1/snapshot_interval of their pages."""
        if snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be at least 1, got {snapshot_interval}")
        self.block_manager = block_manager
        self.groups = groups
        self.block_size = block_manager.block_size
        self.snapshot_interval = snapshot_interval
        self._kinds = [g.kind for g in groups.groups]

    @property
    def num_groups(self) -> int:
        return self.groups.num_groups

    # --- one sequence --------------------------------------------------------------------------

    def allocate_prefix(self, seq: Sequence) -> int:
        """Take the longest cached prefix of seq's tokens that every group can serve (leaving
        at least one token to compute); returns its length in tokens."""
        bm = self.block_manager
        self._check_empty(seq)
        if not bm.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = max(0, (seq.num_tokens - 1) // bs)
        self._extend_hashes(seq, max_blocks)
        found = [self._lookup(seq, g, max_blocks) for g in range(self.num_groups)]
        held = [[b != FREED for b in blocks] for blocks in found]
        length = self._longest_prefix(held, max_blocks)
        for g, blocks in enumerate(found):
            first = self._first_read_block(g, length)
            table = [FREED] * first + blocks[first:length]
            bm.take(table[first:])
            seq.block_tables[g] = table
        bm.prefix_hits += length
        # Blocks after the hit are not looked up but must be computed: they count as misses.
        bm.prefix_misses += max_blocks - length
        return length * bs

    def find_below(
        self, seq: Sequence, num_tokens: int, held_below: Callable[[int, BlockKey], bool]
    ) -> PrefixLoad:
        """After allocate_prefix: the longest prefix of seq's first num_tokens tokens (the last
        left to compute) for which every group holds every block its next query reads, in the
        pool or below it (held_below(hash, key)); the blocks of it the pool lacks are to load."""
        bs, tables = self.block_size, self._tables(seq)
        num_cached = len(tables[0])
        max_blocks = max(0, (num_tokens - 1) // bs)
        self._extend_hashes(seq, max_blocks)
        hashes = seq.block_hashes
        in_pool = [self._lookup(seq, g, max_blocks) for g in range(self.num_groups)]
        held = [
            [
                block != FREED or held_below(group_hash(hashes[i], g), self._key(seq, i))
                for i, block in enumerate(blocks)
            ]
            for g, blocks in enumerate(in_pool)
        ]
        length = max(num_cached, self._longest_prefix(held, max_blocks))
        load = PrefixLoad(num_cached, length, max_blocks, [], [], [])
        for g, blocks in enumerate(in_pool):
            first = self._first_read_block(g, length)
            load.tables.append([FREED] * first + blocks[first:length])
        load.places = sorted(
            (i, g)
            for g, table in enumerate(load.tables)
            for i in range(self._first_read_block(g, length), length)
            if table[i] == FREED
        )
        load.keys = [(group_hash(hashes[i], g), self._key(seq, i)) for i, g in load.places]
        return load

    def allocate_load(self, seq: Sequence, load: PrefixLoad) -> bool:
        """Give seq the tables of `load` (found just now): a reference on each pool block they
        read, a new block for each to load (`load.blocks`); the blocks of its pool hit that
        they no longer read go back. False (and no change) if blocks run out."""
        bm = self.block_manager
        read = [b for table in load.tables for b in table if b != FREED]
        bm.take(read)
        if not bm.can_allocate(len(load.places)):
            bm.free(read)
            return False
        self.free(seq)
        for i, g in load.places:
            load.tables[g][i] = bm.allocate_one()
        load.blocks = [load.tables[g][i] for i, g in load.places]
        seq.block_tables = load.tables
        return True

    def cache_loaded(self, seq: Sequence, load: PrefixLoad, num_loaded: int) -> int:
        """A load ended, its first num_loaded blocks filled: they enter the prefix cache, the
        others go back (FREED in their tables). Returns the longest prefix, in blocks, for which
        seq's tables now hold what every group's next query reads (load.num_blocks unless a
        block failed)."""
        bm, tables = self.block_manager, self._tables(seq)
        for k, ((i, g), (block_hash, key)) in enumerate(zip(load.places, load.keys)):
            block = tables[g][i]
            if k < num_loaded:
                bm.cache_block(block, block_hash, key)
            else:
                tables[g][i] = FREED
                bm.free([block])
        held = [[b != FREED for b in table[: load.num_blocks]] for table in tables]
        return self._longest_prefix(held, load.num_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks that allocate_slots(seq, num_tokens) would take, over every group."""
        per_table = -(-num_tokens // self.block_size)
        return sum(max(0, per_table - len(table)) for table in self._tables(seq))

    def allocate_slots(self, seq: Sequence, num_tokens: int, num_tokens_held: int) -> bool:
        """Grow every group's table to hold num_tokens: True if it did, False (and no change)
        if blocks run out."""
        bm = self.block_manager
        tables = self._tables(seq)
        for table in tables:
            bm.blocks_needed(table, num_tokens, num_tokens_held)  # checks the table's length
        if not bm.can_allocate(self.blocks_needed(seq, num_tokens)):
            return False
        for table in tables:
            bm.allocate_slots(table, num_tokens, num_tokens_held)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register each group's blocks that seq's computed tokens have filled."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if seq.num_computed_tokens > seq.num_tokens or num_full > len(self._tables(seq)[0]):
            raise ValueError(
                f"{seq.num_computed_tokens} computed tokens do not fit {seq.num_tokens} token "
                f"ids in a table of {len(seq.block_tables[0])} blocks"
            )
        self._extend_hashes(seq, num_full)
        hashes = seq.block_hashes
        interval = self.snapshot_interval
        for g, table in enumerate(self._tables(seq)):
            keep = None
            if interval > 1 and isinstance(self._kinds[g], LinearState):
                keep = lambda i: (i + 1) % interval == 0  # noqa: E731
            bm.cache_hashed_blocks(
                table,
                num_full,
                lambda i, g=g: group_hash(hashes[i], g),
                lambda i: self._key(seq, i),
                keep,
            )

    def release_unread(self, seq: Sequence) -> None:
        """Give back every block that no query of seq from its next token on will read."""
        num_blocks = seq.num_computed_tokens // self.block_size
        for g, table in enumerate(self._tables(seq)):
            first = self._first_read_block(g, num_blocks, seq.num_computed_tokens)
            released = [b for b in table[:first] if b != FREED]
            if released:
                self.block_manager.free(released)
                table[:first] = [FREED] * first

    def allocate_arriving(self, seq: Sequence, num_tokens: int, num_tokens_held: int) -> bool:
        """Grow every group's table to num_tokens for KV computed elsewhere (a handoff): only
        the blocks that seq's next query reads get one, the rest stay FREED. False (and no
        change) if blocks run out."""
        bs = self.block_size
        tables = self._tables(seq)
        per_table = -(-num_tokens // bs)
        wanted = []
        for g, table in enumerate(tables):
            self.block_manager.blocks_needed(table, num_tokens_held, num_tokens_held)
            first = self._first_read_block(g, 0, num_tokens)
            wanted.append([i >= first for i in range(len(table), per_table)])
        if not self.block_manager.can_allocate(sum(sum(w) for w in wanted)):
            return False
        for table, flags in zip(tables, wanted):
            for needed in flags:
                table.append(self.block_manager.allocate_one() if needed else FREED)
        return True

    def readable_tables(self, seq: Sequence, num_computed: int) -> list[list[int]]:
        """Copies of seq's tables with FREED where no query after num_computed tokens reads:
        what a handoff of those tokens' KV moves (it holds and sends these blocks)."""
        out = []
        for g, table in enumerate(self._tables(seq)):
            first = self._first_read_block(g, 0, num_computed)
            out.append([FREED] * min(first, len(table)) + table[first:])
        return out

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back each table's blocks past those num_tokens need (rejected drafts' KV)."""
        keep = -(-num_tokens // self.block_size)
        for table in self._tables(seq):
            if len(table) > keep:
                tail = [b for b in table[keep:] if b != FREED]
                del table[keep:]
                self.block_manager.free(tail)

    def free(self, seq: Sequence) -> None:
        """Give back every block of every group; the tables end empty."""
        for table in self._tables(seq):
            held = [b for b in table if b != FREED]
            table.clear()
            self.block_manager.free(held)

    def num_blocks_held(self, seq: Sequence) -> int:
        return sum(sum(1 for b in table if b != FREED) for table in self._tables(seq))

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one sequence of num_tokens holds at once, computed in chunks of at
        most max_chunk tokens: a full group's every block; a windowed or chunked group's blocks
        under its reach before a chunk and the chunk itself (given back after each step)."""
        bs = self.block_size
        whole = -(-num_tokens // bs)
        total = 0
        for kind in self._kinds:
            reach = kind.reach
            span = num_tokens if reach is None else reach + max_chunk
            total += min(whole, -(-span // bs) + 1)
        return total

    def handoff_size(self, num_tokens: int) -> int:
        """Blocks a handoff of a sequence's first num_tokens moves (and allocate_arriving
        reserves for a sequence holding none): each group's blocks from the first that the
        query after them reads."""
        return self.groups.blocks_read(num_tokens, self.block_size)

    def longest_sequence(self, num_blocks: int, max_chunk: int, limit: int) -> int:
        """The most tokens (up to limit) one sequence may hold in a pool of num_blocks."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(mid, max_chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # --- internals ----------------------------------------------------------------------------

    def _tables(self, seq: Sequence) -> list[list[int]]:
        while len(seq.block_tables) < self.num_groups:
            seq.block_tables.append([])
        return seq.block_tables

    def _check_empty(self, seq: Sequence) -> None:
        if any(self._tables(seq)):
            raise ValueError(f"{seq.request_id} already holds blocks")

    def _first_read_block(self, g: int, num_blocks: int, position: int | None = None) -> int:
        """The first block the next query reads, after num_blocks full blocks (or at a given
        position)."""
        position = num_blocks * self.block_size if position is None else position
        return self._kinds[g].first_read(position) // self.block_size

    def _extend_hashes(self, seq: Sequence, num_full: int) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _key(self, seq: Sequence, i: int) -> BlockKey:
        """What full block i holds (its parent's hash, its tokens), to verify a hit against."""
        bs = self.block_size
        return (seq.block_hashes[i - 1] if i else None, tuple(seq.token_ids[i * bs : (i + 1) * bs]))

    def _lookup(self, seq: Sequence, g: int, max_blocks: int) -> list[int]:
        """Group g's cached block for each of the first max_blocks blocks, or FREED."""
        bm, hashes = self.block_manager, seq.block_hashes
        found = []
        for i in range(max_blocks):
            block = bm.cached_block(group_hash(hashes[i], g), self._key(seq, i))
            found.append(FREED if block is None else block)
        return found

    def _longest_prefix(self, held: list[list[bool]], limit: int) -> int:
        """The largest n <= limit such that every group g holds (held[g][i]) every block its
        query after n blocks reads."""
        length = limit
        while True:  # each group's longest hit within the others'; a fixpoint in a few rounds
            shortest = min(self._longest_hit(g, held[g], length) for g in range(self.num_groups))
            if shortest == length:
                return length
            length = shortest

    def _longest_hit(self, g: int, held: list[bool], limit: int) -> int:
        """The largest n <= limit such that group g holds every block its query after n
        blocks reads."""
        missing_before = [-1] * (limit + 1)  # n -> the last block before n not held, or -1
        for i in range(limit):
            missing_before[i + 1] = missing_before[i] if held[i] else i
        for n in range(limit, 0, -1):
            if missing_before[n] < self._first_read_block(g, n):
                return n
        return 0
