"""KV groups without a model: how layers of mixed kinds form groups, and the KV manager's
invariants over a sequence's per-group tables (a window's blocks stay bounded as a sequence
grows, a prefix hit gives every group what its next query reads, every block comes back)."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.cluster.block_hash import hash_block_tokens
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.groups import KVGroups, groups_for
from pdserve.engine.kv.kv_manager import FREED, KVCacheManager, handoff_blocks
from pdserve.engine.kv.layer_kinds import ChunkedLocal, FullAttention, SlidingWindow, parse_kind
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence

FULL, W8 = FullAttention(), SlidingWindow(8)


def seq_of(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=1000, ignore_eos=True))


def test_alternating_layers_form_two_groups_of_equal_size_full_first():
    groups = KVGroups.for_layers([W8, FULL, W8, FULL])
    assert [g.kind for g in groups.groups] == [FULL, W8]
    assert [g.layers for g in groups.groups] == [(1, 3), (0, 2)]
    assert groups.group_of == (1, 0, 1, 0) and groups.slot_of == (0, 0, 1, 1)
    assert groups.num_slots == 2


def test_five_sliding_layers_to_one_full_split_into_groups_of_the_smaller_kind():
    kinds = [W8] * 5 + [FULL]
    groups = KVGroups.for_layers(kinds)
    assert groups.num_groups == 6 and groups.num_slots == 1
    assert groups.groups[0].layers == (5,)
    assert groups.kinds == tuple(kinds)


def test_uneven_kinds_leave_the_last_group_short():
    groups = KVGroups.for_layers([FULL, FULL] + [W8] * 5)
    assert [len(g.layers) for g in groups.groups] == [2, 2, 2, 1]
    assert groups.num_slots == 2


def test_a_slot_is_complete_once_every_groups_layer_in_it_is():
    groups = KVGroups.for_layers([W8, FULL, W8, FULL])  # slot 0: layers 1, 0; slot 1: 3, 2
    assert [groups.slots_done_after(layer) for layer in range(4)] == [0, 1, 1, 2]
    assert [groups_for(3, ()).slots_done_after(layer) for layer in range(3)] == [1, 2, 3]


def test_one_kind_is_one_group_with_a_slot_per_layer():
    groups = groups_for(4, ())
    assert groups.is_uniform and groups.num_slots == 4 and groups.slot_of == (0, 1, 2, 3)


def test_kinds_read_what_transformers_masks_allow():
    assert SlidingWindow(4).first_read(10) == 7  # keys 7, 8, 9, 10
    assert ChunkedLocal(8).first_read(10) == 8
    assert ChunkedLocal(8).first_read(7) == 0
    assert FULL.first_read(10) == 0
    for label in ("full", "sliding 128", "chunked 8192"):
        assert parse_kind(label).label == label
    with pytest.raises(ValueError):
        parse_kind("sliding")


def grow(kv: KVCacheManager, seq: Sequence, steps: int) -> list[int]:
    """Decode `steps` tokens as the scheduler would (allocate, compute, register, release);
    returns the blocks held after each step."""
    held = []
    for _ in range(steps):
        computed = seq.num_computed_tokens
        assert kv.allocate_slots(seq, seq.num_tokens, computed)
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(random.randrange(100))
        kv.cache_full_blocks(seq)
        kv.release_unread(seq)
        held.append(kv.num_blocks_held(seq))
    return held


@pytest.mark.parametrize("block_size", [4, 3])
def test_a_windowed_groups_blocks_stay_bounded_while_a_sequence_grows(block_size):
    bm = BlockManager(200, block_size)
    kv = KVCacheManager(bm, KVGroups.for_layers([W8, FULL]))
    seq = seq_of([1, 2, 3])
    grow(kv, seq, 120)
    full, window = seq.block_tables
    assert FREED not in full and len(full) == -(-seq.num_computed_tokens // block_size)
    live = [b for b in window if b != FREED]
    # The next query reads 8 tokens back: they span at most ceil(7 / bs) + 1 blocks, plus the
    # block the next token goes in.
    assert len(live) <= -(-7 // block_size) + 2
    assert window[: len(window) - len(live)] == [FREED] * (len(window) - len(live))
    kv.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_chunked_group_keeps_only_the_current_chunk():
    bm = BlockManager(100, 4)
    kv = KVCacheManager(bm, KVGroups.for_layers([ChunkedLocal(16), FULL]))
    seq = seq_of([1])
    grow(kv, seq, 40)  # 41 tokens computed by the end... the next query is at 40: chunk 32..47
    chunk_table = seq.block_tables[1]
    assert [b == FREED for b in chunk_table[:8]] == [True] * 8
    assert all(b != FREED for b in chunk_table[8:])


def finished_prompt(kv: KVCacheManager, tokens: list[int]) -> None:
    """Compute a prompt's KV and finish the sequence: its blocks stay in the prefix cache."""
    seq = seq_of(tokens, "first")
    assert kv.allocate_slots(seq, len(tokens), 0)
    seq.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(seq)
    kv.release_unread(seq)
    kv.free(seq)


def test_a_prefix_hit_gives_a_window_only_the_blocks_its_next_query_reads():
    bm = BlockManager(100, 4)
    kv = KVCacheManager(bm, KVGroups.for_layers([W8, FULL]))
    prompt = list(range(10, 50))  # 40 tokens: 10 blocks
    finished_prompt(kv, prompt)
    seq = seq_of(prompt + [7, 8], "second")
    cached = kv.allocate_prefix(seq)
    assert cached == 40  # (42 - 1) // 4 = 10 blocks
    full, window = seq.block_tables
    assert len(full) == len(window) == 10 and FREED not in full
    # The query at position 40 reads 33..40: blocks 8 and 9 (and 10, not yet computed).
    assert window[:8] == [FREED] * 8 and FREED not in window[8:]
    kv.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_hit_is_no_longer_than_every_group_can_serve():
    bm = BlockManager(20, 4)  # the prompt's 10 blocks in each group: nothing left on the free list
    kv = KVCacheManager(bm, KVGroups.for_layers([W8, FULL]))
    prompt = list(range(10, 50))
    finished_prompt(kv, prompt)
    # Evict the window group's last cached block: the full group still holds all 10.
    seq = seq_of(prompt + [1], "probe")
    kv.allocate_prefix(seq)
    last_window_block = seq.block_tables[1][-1]
    kv.free(seq)
    bm._evictable.move_to_end(last_window_block, last=False)
    taken = bm._allocate_fresh()
    assert taken == last_window_block
    seq = seq_of(prompt + [1], "again")
    # Without block 9 of the window, the longest prefix whose window is whole ends at 9 blocks
    # (the query at 36 reads 29..36: blocks 7 and 8, both cached).
    assert kv.allocate_prefix(seq) == 36
    assert len(seq.block_tables[0]) == 9
    bm.free([taken])
    kv.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_window_hits_without_the_blocks_before_its_window():
    bm = BlockManager(20, 4)
    kv = KVCacheManager(bm, KVGroups.for_layers([W8, FULL]))
    prompt = list(range(10, 50))
    finished_prompt(kv, prompt)
    # The window group's block 0, given back (and cached) as the window moved on: evict it.
    full_block = bm.cached_block(hash_block_tokens(None, prompt[:4]), (None, tuple(prompt[:4])))
    first_window_block = next(
        b for b in bm._evictable if bm._key[b] == (None, tuple(prompt[:4])) and b != full_block
    )
    bm._evictable.move_to_end(first_window_block, last=False)
    taken = bm._allocate_fresh()
    assert taken == first_window_block
    seq = seq_of(prompt + [1], "again")
    assert kv.allocate_prefix(seq) == 40  # its next query reads blocks 8 and 9 only
    bm.free([taken])
    kv.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


class ManagerMachine(RuleBasedStateMachine):
    """Sequences sharing prompt heads arrive, grow, take hits, preempt and finish under a pool
    small enough to run out: references always equal the live tables holding each block, a
    window group never holds a block its next query cannot read, and every block comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(48, 4)
        self.kv = KVCacheManager(self.bm, KVGroups.for_layers([SlidingWindow(6), FULL]))
        self.live: list[Sequence] = []
        self.count = 0

    @rule(head=st.integers(0, 2), extra=st.integers(1, 20))
    def arrive(self, head: int, extra: int) -> None:
        tokens = [head] * 9 + list(range(100 + self.count, 100 + self.count + extra))
        seq = seq_of(tokens, f"r{self.count}")
        self.count += 1
        seq.num_computed_tokens = self.kv.allocate_prefix(seq)
        if self.kv.allocate_slots(seq, seq.num_tokens, seq.num_computed_tokens):
            seq.num_computed_tokens = seq.num_tokens
            self.kv.cache_full_blocks(seq)
            self.kv.release_unread(seq)
            self.live.append(seq)
        else:
            self.kv.free(seq)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10), steps=st.integers(1, 6))
    def decode(self, pick: int, steps: int) -> None:
        seq = self.live[pick % len(self.live)]
        for _ in range(steps):
            seq.append_token(7)
            if not self.kv.allocate_slots(seq, seq.num_tokens, seq.num_computed_tokens):
                seq.token_ids.pop()  # as a preempted step: nothing computed
                return
            seq.num_computed_tokens = seq.num_tokens
            self.kv.cache_full_blocks(seq)
            self.kv.release_unread(seq)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10))
    def finish(self, pick: int) -> None:
        seq = self.live.pop(pick % len(self.live))
        self.kv.free(seq)

    @invariant()
    def references_equal_the_live_tables(self) -> None:
        counts: dict[int, int] = {}
        for seq in self.live:
            for table in seq.block_tables:
                for block in table:
                    if block != FREED:
                        counts[block] = counts.get(block, 0) + 1
        for block in range(self.bm.num_blocks):
            assert self.bm.ref_count(block) == counts.get(block, 0)

    @invariant()
    def a_window_holds_only_what_its_next_query_reads(self) -> None:
        for seq in self.live:
            first = max(0, seq.num_computed_tokens - 6 + 1) // 4
            assert all(b == FREED for b in seq.block_tables[1][:first])

    def teardown(self) -> None:
        for seq in self.live:
            self.kv.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_the_scheduler_frees_a_windowed_groups_old_blocks_as_decoding_goes_on():
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, 4, 64, kv_groups=KVGroups.for_layers([W8, FULL]))
    seq = seq_of(list(range(30)))
    scheduler.add(seq)
    for _ in range(40):
        out = scheduler.schedule()
        scheduler.postprocess(out, {0: 5}, max_model_len=1000)
    window = seq.block_tables[1]
    assert sum(b != FREED for b in window) <= 4
    scheduler.abort(seq.request_id)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kinds", [[W8, FULL], [ChunkedLocal(16), FULL, ChunkedLocal(16)], [W8]])
def test_handoff_size_is_what_a_prefill_sends_and_allocate_arriving_reserves(kinds):
    groups = KVGroups.for_layers(kinds)
    for n in (1, 7, 8, 9, 16, 33, 40, 47, 48, 100):
        prefill = KVCacheManager(BlockManager(200, 4), groups)
        seq = seq_of(list(range(n)))
        grow(prefill, seq, 1)  # the prompt computed in one step, its unread blocks given back
        sent = handoff_blocks(seq.block_tables, 0)
        decode = KVCacheManager(BlockManager(200, 4), groups)
        arriving = seq_of(list(range(n)))
        assert decode.allocate_arriving(arriving, n, 0)
        reserved = handoff_blocks(arriving.block_tables, 0)
        assert prefill.handoff_size(n) == len(sent) == len(reserved), n
