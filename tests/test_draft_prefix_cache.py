"""Specification of the draft model's KV bookkeeping with prefix caching, without a model: the
proposer's catch-up, drafts, rollback and release over a shadow pool whose every slot holds a
digest of the tokens up to its position, read back through the sequence's own table, so a cached
block holding anything but its sequence's tokens, a write into a shared block, or a block freed
while shared shows up as a wrong draft or a wrong count."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.cluster.block_hash import hash_block_tokens
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.draft_model import DraftModelProposer

BS = 4
VOCAB = 3  # so that drafts often equal the tokens that follow, and prompts share prefixes
PROMPT_HEADS = [[], [0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2, 1, 0], [2, 2, 2, 2, 2]]


def digest(previous: int | None, token: int) -> int:
    """A slot's shadow KV: its token's, given the KV before it (as attention reads it)."""
    return hash((previous, token)) & 0xFFFFFFFF


def digests(tokens: list[int]) -> list[int]:
    """The shadow KV a sequence of tokens has when every position is computed from its own."""
    out: list[int] = []
    for token in tokens:
        out.append(digest(out[-1] if out else None, token))
    return out


class ShadowProposer(DraftModelProposer):
    """The draft_model proposer's bookkeeping, its forward a write of digests into a shadow pool
    (a slot's digest chains from the slot before it, read through the chunk's table) and its
    draft the last written digest modulo VOCAB: the draft the real sequence's tokens give."""

    def __init__(self, num_blocks: int, max_catch_up: int) -> None:  # no model, no pool
        self.block_manager = BlockManager(num_blocks, BS)
        self.adaptive = False
        self.max_positions = 1 << 20
        self.max_catch_up = max_catch_up
        self.num_catch_up_tokens = self.num_cached_tokens = 0
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset): digest

    def _forward(self, chunks: list[tuple[list[int], int, list[int], bool]]) -> list[int]:
        drafts = []
        for tokens, start, table, samples in chunks:
            for i, token in enumerate(tokens):
                pos = start + i
                previous = self.slots.get((table[(pos - 1) // BS], (pos - 1) % BS)) if pos else None
                self.slots[table[pos // BS], pos % BS] = digest(previous, token)
            if samples:
                end = start + len(tokens) - 1
                drafts.append(self.slots[table[end // BS], end % BS] % VOCAB)
        return drafts


class DraftCacheMachine(RuleBasedStateMachine):
    """Sequences arrive with prompts that share heads, take drafts in steps (some of them
    accepted, then a token of the target's own), are preempted (released, later drafting again)
    or finish; the draft pool is small, so catch-ups fail for room, and cached blocks are
    evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.proposer = ShadowProposer(num_blocks=14, max_catch_up=10)
        self.seqs: list[Sequence] = []
        self.chains: dict[int, list[int]] = {}  # a block hash: every token of its chain
        self.count = 0

    def _remember_chains(self, seq: Sequence) -> None:
        parent = None
        for i in range(seq.num_tokens // BS):
            parent = hash_block_tokens(parent, tuple(seq.token_ids[i * BS : (i + 1) * BS]))
            self.chains[parent] = seq.token_ids[: (i + 1) * BS]

    @precondition(lambda self: len(self.seqs) < 4)
    @rule(head=st.sampled_from(PROMPT_HEADS), tail=st.lists(st.integers(0, VOCAB - 1), max_size=6))
    def arrive(self, head: list[int], tail: list[int]) -> None:
        self.count += 1
        seq = Sequence(f"s{self.count}", [7, *head, *tail], SamplingParams(max_tokens=1000))
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(
        data=st.data(),
        ks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    )
    def step(self, data: st.DataObject, ks: list[int]) -> None:
        batch = [(seq, k) for seq, k in zip(self.seqs, ks)]
        drafts = self.proposer.draft(batch)
        for (seq, k), proposed in zip(batch, drafts):
            assert len(proposed) in (0, k)
            if proposed:  # the draft model's own greedy continuation of the sequence
                chain = digests(seq.token_ids)
                expected = []
                for _ in proposed:
                    expected.append(chain[-1] % VOCAB)
                    chain.append(digest(chain[-1], expected[-1]))
                assert proposed == expected
            accepted = data.draw(st.integers(0, len(proposed)))
            own = data.draw(st.integers(0, VOCAB - 1))
            before = seq.num_tokens
            for token in [*proposed[:accepted], own]:
                seq.append_token(token)
            if proposed:
                self.proposer.rollback(seq, before + accepted)
        for seq in self.seqs:  # those beyond the batch decode plainly
            if all(seq is not s for s, _ in batch):
                seq.append_token(data.draw(st.integers(0, VOCAB - 1)))
            self._remember_chains(seq)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), finished=st.booleans())
    def leave(self, index: int, finished: bool) -> None:
        """Finished or aborted (gone), or preempted (released, drafting again later)."""
        seq = self.seqs[index % len(self.seqs)]
        self.proposer.release(seq)
        assert not seq.draft_block_table and seq.num_draft_computed_tokens == 0
        if finished:
            self.seqs.remove(seq)

    @invariant()
    def a_cached_block_holds_its_sequences_own_tokens_at_every_position(self) -> None:
        bm = self.proposer.block_manager
        for block in range(bm.num_blocks):
            h = bm.registered_hash(block)
            if h is None:
                continue
            expected = digests(self.chains[h])[-BS:]
            assert [self.proposer.slots.get((block, j)) for j in range(BS)] == expected

    @invariant()
    def ref_counts_equal_the_live_tables_holding_each_block(self) -> None:
        bm = self.proposer.block_manager
        holders = Counter(b for seq in self.seqs for b in seq.draft_block_table)
        assert all(
            count == 1 for seq in self.seqs for count in Counter(seq.draft_block_table).values()
        )
        for block in range(bm.num_blocks):
            assert bm.ref_count(block) == holders[block]

    @invariant()
    def a_table_holds_the_blocks_of_its_computed_tokens_and_no_more(self) -> None:
        for seq in self.seqs:
            assert seq.num_draft_computed_tokens < seq.num_tokens
            assert len(seq.draft_block_table) == -(-seq.num_draft_computed_tokens // BS)

    def teardown(self) -> None:
        for seq in self.seqs:
            self.proposer.release(seq)
        bm = self.proposer.block_manager
        assert bm.num_free_blocks == bm.num_blocks


DraftCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_draft_cache_keeps_its_invariants_under_any_sequence_of_steps = DraftCacheMachine.TestCase


def test_a_repeated_prompt_catches_up_after_its_cached_blocks():
    proposer = ShadowProposer(num_blocks=14, max_catch_up=10)
    params = SamplingParams(max_tokens=100)
    first, second = (Sequence(rid, [7, *PROMPT_HEADS[1], 2], params) for rid in "ab")
    drafts = proposer.draft([(first, 2)])
    proposer.release(first)
    assert proposer.num_catch_up_tokens == 10 and proposer.num_cached_tokens == 0
    assert proposer.draft([(second, 2)]) == drafts
    assert proposer.num_cached_tokens == 8  # two blocks of the ten tokens
    assert proposer.num_catch_up_tokens == 10 + 2
    proposer.release(second)
    assert proposer.block_manager.num_free_blocks == 14
