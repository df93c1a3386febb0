"""Specification of the block manager: block accounting, prefix caching, LRU eviction."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pdserve.engine.kv.block_manager as block_manager_module
from pdserve.engine.kv.block_manager import BlockManager

BS = 4
# Shared prompt heads so that prefixes repeat: two share a first block and then diverge.
SYSTEM_PROMPTS = [[], [0, 1, 1, 0, 1, 0, 0, 1], [0, 1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


def computed_table(mgr: BlockManager, tokens: list[int]) -> list[int]:
    """A table as after prefill of tokens: prefix hits, fresh slots, full blocks registered."""
    table = mgr.allocate_prefix(tokens)
    assert mgr.allocate_slots(table, len(tokens), len(table) * mgr.block_size)
    mgr.cache_full_blocks(table, tokens, len(tokens))
    return table


def state(mgr: BlockManager) -> dict:
    return copy.deepcopy(vars(mgr))


def test_rejects_nonpositive_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_new_manager_has_every_block_free() -> None:
    mgr = BlockManager(8, BS)
    assert (mgr.num_free_blocks, mgr.num_used_blocks, mgr.usage) == (8, 0, 0.0)


def test_allocate_slots_grows_the_table_in_place_to_hold_the_tokens() -> None:
    mgr = BlockManager(8, BS)
    table: list[int] = []
    assert mgr.blocks_needed(table, 9) == 3
    assert mgr.allocate_slots(table, 9, 0) is True
    assert len(table) == 3 and len(set(table)) == 3
    assert mgr.blocks_needed(table, 12, 9) == 0
    assert mgr.allocate_slots(table, 12, 9) is True
    assert len(table) == 3
    assert mgr.allocate_slots(table, 13, 12) is True
    assert len(table) == 4
    assert (mgr.num_used_blocks, mgr.usage) == (4, 0.5)


def test_allocate_slots_returns_false_and_changes_nothing_when_blocks_run_out() -> None:
    mgr = BlockManager(4, BS)
    table = computed_table(mgr, [1, 2, 3, 4, 5])  # 2 blocks held, 2 free; 17 tokens need 5
    before, table_before = state(mgr), list(table)
    assert mgr.blocks_needed(table, 17, 5) == 3
    assert not mgr.can_allocate(mgr.blocks_needed(table, 17, 5))
    assert mgr.allocate_slots(table, 17, 5) is False
    assert state(mgr) == before and table == table_before


def test_allocate_slots_rejects_a_table_that_does_not_match_the_tokens_held() -> None:
    mgr = BlockManager(8, BS)
    table: list[int] = []
    mgr.allocate_slots(table, 8, 0)
    with pytest.raises(ValueError, match="tokens held"):
        mgr.allocate_slots(table, 10, 3)


def test_allocate_prefix_returns_the_blocks_holding_the_same_tokens() -> None:
    mgr = BlockManager(16, BS)
    prompt = list(range(10))  # blocks [0..3], [4..7], then 2 tokens
    first = computed_table(mgr, prompt)
    second = mgr.allocate_prefix(prompt[:8] + [99, 98, 97])
    assert second == first[:2]
    assert [mgr.ref_count(b) for b in first] == [2, 2, 1]
    assert (mgr.prefix_hits, mgr.prefix_misses) == (2, 2)  # the first lookup missed both


def test_allocate_prefix_never_covers_the_whole_prompt() -> None:
    mgr = BlockManager(16, BS)
    prompt = list(range(8))  # exactly two full blocks
    table = computed_table(mgr, prompt)
    assert mgr.num_cached_blocks == 2
    # The last token must be computed to get logits, so only the first block is reused.
    assert mgr.allocate_prefix(prompt) == table[:1]
    assert mgr.allocate_prefix(prompt + [8]) == table
    assert mgr.allocate_prefix(prompt[:4]) == []
    assert mgr.allocate_prefix([]) == []


def test_a_block_hits_only_after_the_same_parent_chain() -> None:
    mgr = BlockManager(16, BS)
    computed_table(mgr, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    hits = mgr.prefix_hits
    assert mgr.allocate_prefix([3, 3, 3, 3, 2, 2, 2, 2, 0]) == []
    assert mgr.prefix_hits == hits


def test_hash_collision_never_returns_wrong_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens: 7)
    mgr = BlockManager(16, BS)
    cached = computed_table(mgr, [1, 2, 3, 4, 0])
    assert mgr.allocate_prefix([5, 6, 7, 8, 0]) == []
    assert mgr.allocate_prefix([1, 2, 3, 4, 0]) == cached[:1]


def test_cached_block_is_reused_after_its_table_is_freed() -> None:
    mgr = BlockManager(8, BS)
    prompt = list(range(9))
    table = computed_table(mgr, prompt)
    first_two = table[:2]
    mgr.free(table)
    assert table == [] and mgr.num_free_blocks == 8  # cached blocks still count as free
    assert mgr.num_cached_blocks == 2
    assert mgr.allocate_prefix(prompt) == first_two
    assert mgr.num_used_blocks == 2


def test_identical_block_computed_twice_keeps_the_existing_entry() -> None:
    mgr = BlockManager(8, BS)
    prompt = [1, 2, 3, 4, 5]
    a: list[int] = []
    b: list[int] = []
    mgr.allocate_slots(a, 5, 0)
    mgr.allocate_slots(b, 5, 0)  # computed concurrently, before either was cached
    mgr.cache_full_blocks(a, prompt, 5)
    mgr.cache_full_blocks(b, prompt, 5)
    assert mgr.num_cached_blocks == 1
    assert mgr.allocate_prefix(prompt) == a[:1]
    b_head = b[0]
    mgr.free(b)
    assert mgr.ref_count(b_head) == 0
    assert mgr.allocate_prefix(prompt) == a[:1]  # the duplicate's free did not break the entry


def test_lru_evicts_the_least_recently_freed_and_tails_before_heads() -> None:
    mgr = BlockManager(4, BS)
    older = computed_table(mgr, [1, 1, 1, 1, 1, 1, 1, 1])
    newer = computed_table(mgr, [2, 2, 2, 2, 2, 2, 2, 2])
    old_head, old_tail = older
    new_head, new_tail = newer
    mgr.free(older)
    mgr.free(newer)
    assert mgr.num_free_blocks == 4
    order = []
    for _ in range(4):
        table: list[int] = []
        mgr.allocate_slots(table, 1, 0)
        order.append(table[0])
    assert order == [old_tail, old_head, new_tail, new_head]
    assert mgr.num_cached_blocks == 0


def test_plain_free_blocks_are_used_before_evicting_cached_ones() -> None:
    mgr = BlockManager(4, BS)
    table = computed_table(mgr, [1, 1, 1, 1, 0])
    cached = table[0]
    mgr.free(table)
    mgr.allocate_slots(table, 12, 0)
    assert cached not in table
    assert mgr.allocate_prefix([1, 1, 1, 1, 0]) == [cached]


def test_a_prefix_hit_refreshes_recency() -> None:
    mgr = BlockManager(2, BS)
    a = computed_table(mgr, [1, 1, 1, 1])
    b = computed_table(mgr, [2, 2, 2, 2])
    a_block, b_block = a[0], b[0]
    mgr.free(a)
    mgr.free(b)
    mgr.free(mgr.allocate_prefix([1, 1, 1, 1, 0]))  # a's block is now the most recently used
    table: list[int] = []
    mgr.allocate_slots(table, 1, 0)
    assert table == [b_block]
    assert mgr.allocate_prefix([1, 1, 1, 1, 0]) == [a_block]


def test_double_free_raises_and_changes_nothing() -> None:
    mgr = BlockManager(8, BS)
    table = computed_table(mgr, [1, 2, 3, 4, 5])
    stale = list(table)
    mgr.free(table)
    live = computed_table(mgr, [9])
    before = state(mgr)
    with pytest.raises(ValueError, match="double free"):
        mgr.free(stale)
    with pytest.raises(ValueError, match="double free"):
        mgr.free([live[0], live[0]])  # held once, freed twice
    assert state(mgr) == before


def test_disabled_prefix_caching_caches_nothing() -> None:
    mgr = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    mgr.free(computed_table(mgr, prompt))
    assert mgr.allocate_prefix(prompt) == []
    assert (mgr.num_cached_blocks, mgr.prefix_hits, mgr.prefix_misses) == (0, 0, 0)


def test_reset_prefix_cache_forgets_unreferenced_blocks_only() -> None:
    mgr = BlockManager(8, BS)
    live = computed_table(mgr, [1, 1, 1, 1, 0])
    mgr.free(computed_table(mgr, [2, 2, 2, 2, 0]))
    mgr.reset_prefix_cache()
    assert mgr.num_cached_blocks == 1 and mgr.num_free_blocks == 6
    assert mgr.allocate_prefix([2, 2, 2, 2, 0]) == []
    assert mgr.allocate_prefix([1, 1, 1, 1, 0]) == live[:1]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences of prefill, decode, cache and free, against a model of the pages.

    `pages` is the shadow KV pool: the token id each slot of each block was written with, so any
    wrong prefix hit, write into a shared block or reuse of a live block shows up as wrong content.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mgr = BlockManager(num_blocks=12, block_size=BS)
        self.seqs: list[dict] = []  # {"table", "tokens", "computed"}
        self.pages: dict[int, list[int | None]] = {}

    @precondition(lambda self: len(self.seqs) < 4)  # keep blocks cycling through free and cache
    @rule(
        system=st.sampled_from(SYSTEM_PROMPTS),
        user=st.lists(st.integers(0, 1), min_size=1, max_size=10),
        num_new=st.integers(1, 18),
        cache=st.booleans(),
    )
    def add_sequence(self, system: list[int], user: list[int], num_new: int, cache: bool) -> None:
        prompt = system + user
        table = self.mgr.allocate_prefix(prompt)
        assert len(table) <= (len(prompt) - 1) // BS
        for i, block in enumerate(table):
            assert self.pages[block] == prompt[i * BS : (i + 1) * BS]
        seq = {"table": table, "tokens": list(prompt), "computed": len(table) * BS}
        self.seqs.append(seq)
        self._compute(seq, num_new, cache)  # the first prefill chunk

    @precondition(lambda self: self.seqs)
    @rule(
        index=st.integers(0, 100),
        num_new=st.integers(1, 9),
        new_tokens=st.lists(st.integers(0, 1), max_size=9),
        cache=st.booleans(),
    )
    def compute(self, index: int, num_new: int, new_tokens: list[int], cache: bool) -> None:
        seq = self.seqs[index % len(self.seqs)]
        if seq["computed"] == len(seq["tokens"]):  # prompt done: decode (or speculate) tokens
            seq["tokens"].extend(new_tokens or [0])
        self._compute(seq, num_new, cache)

    def _compute(self, seq: dict, num_new: int, cache: bool) -> None:
        """Allocate slots for up to num_new more tokens and write them into the shadow pages."""
        table, tokens, held = seq["table"], seq["tokens"], seq["computed"]
        target = min(held + num_new, len(tokens))
        before, table_before = state(self.mgr), list(table)
        used_before = self.mgr.num_used_blocks
        needed = self.mgr.blocks_needed(table, target, held)
        if not self.mgr.allocate_slots(table, target, held):
            assert not self.mgr.can_allocate(needed)
            assert state(self.mgr) == before and table == table_before
            return
        assert self.mgr.num_used_blocks - used_before == needed
        for block in table[len(table_before) :]:
            self.pages[block] = [None] * BS  # fresh block: garbage until written
        for pos in range(held, target):
            block = table[pos // BS]
            assert self.mgr.ref_count(block) == 1, "writing into a shared block"
            self.pages[block][pos % BS] = tokens[pos]
        seq["computed"] = target
        if cache:
            self.mgr.cache_full_blocks(table, tokens, target)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def cache(self, index: int) -> None:
        seq = self.seqs[index % len(self.seqs)]
        self.mgr.cache_full_blocks(seq["table"], seq["tokens"], seq["computed"])

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        seq = self.seqs.pop(index % len(self.seqs))
        self.mgr.free(seq["table"])
        assert seq["table"] == []

    @rule()
    def reset_prefix_cache(self) -> None:
        self.mgr.reset_prefix_cache()

    @invariant()
    def free_plus_used_equals_total(self) -> None:
        assert self.mgr.num_free_blocks + self.mgr.num_used_blocks == self.mgr.num_blocks

    @invariant()
    def no_block_is_both_free_and_referenced_nor_free_twice(self) -> None:
        free = list(self.mgr._free) + list(self.mgr._evictable)
        assert len(free) == len(set(free)) == self.mgr.num_free_blocks
        referenced = {b for b in range(self.mgr.num_blocks) if self.mgr.ref_count(b) > 0}
        assert referenced.isdisjoint(free)
        assert referenced | set(free) == set(range(self.mgr.num_blocks))

    @invariant()
    def ref_counts_equal_the_live_tables_holding_each_block(self) -> None:
        holders = Counter(b for seq in self.seqs for b in seq["table"])
        for block in range(self.mgr.num_blocks):
            assert self.mgr.ref_count(block) == holders[block]

    @invariant()
    def every_live_sequence_reads_back_its_own_tokens(self) -> None:
        for seq in self.seqs:
            for pos in range(seq["computed"]):
                assert self.pages[seq["table"][pos // BS]][pos % BS] == seq["tokens"][pos]

    def teardown(self) -> None:
        for seq in self.seqs:
            self.mgr.free(seq["table"])
        assert self.mgr.num_free_blocks == self.mgr.num_blocks
        assert self.mgr.num_used_blocks == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_free_plus_used_equals_total_under_any_operation_sequence = BlockManagerMachine.TestCase
