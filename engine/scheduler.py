"""Iteration-level scheduling: each step, one batch of running decodes and prefill chunks within
`max_num_seqs` and `max_num_batched_tokens`; preemption by recompute when blocks run out.

The scheduler decides (which sequences, how many tokens, which blocks); the model runner
executes. Two admission policies share the step loop: `continuous` admits waiting requests
whenever there is room; `static` forms a batch and admits nothing new until all of it finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.groups import KVGroups
from pdserve.engine.kv.kv_manager import KVCacheManager
from pdserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pdserve.engine.kv.tiers import KVTiers, TierLoad
    from pdserve.engine.spec_decode.speculation import Proposer


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    # A chunk reaching the end of the sequence samples a token after it. A speculating decode's
    # count includes its draft tokens (seq.draft_token_ids), each verified in the same step.
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "continuous",
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        max_model_len: int | None = None,
        tiers: KVTiers | None = None,
        disable_speculation_above: int | None = None,
        kv_groups: KVGroups | None = None,
    ) -> None:
        """proposer: speculative decoding's (with num_speculative_tokens, the most a step
        verifies per sequence, max_model_len, which drafts stay within, and
        disable_speculation_above, the most running sequences a step that verifies drafts may
        have). tiers: the KV tiers under the pool, which a waiting sequence's prefix is loaded
        back from. kv_groups: the model's layer groups (default: one, every layer full
        attention)."""
        self.block_manager = block_manager
        self.kv = KVCacheManager(block_manager, kv_groups or KVGroups.uniform(1))
        self.tiers = tiers
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_speculation_above = disable_speculation_above
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is preempted first
        # Out of the waiting queue while blocks of their prefix load from a lower tier; back at
        # its head once the load ended (`loaded`).
        self.loading: dict[str, Sequence] = {}
        self.static_batch: set[str] = set()  # static policy: ids of the batch in flight
        self.num_preemptions = 0
        self.num_prefill_tokens_computed = 0

    # --- queue -------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Take in a sequence whose blocks are already allocated and filled (a KV handoff)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.loading.pop(request_id, None)
        if seq is not None:  # its blocks are freed when the load ends (`loaded`)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            self.static_batch.discard(request_id)
            return seq
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        self.static_batch.discard(seq.request_id)

    # --- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Running sequences first, oldest first, so the oldest is never starved. A decoding
        # sequence that may speculate reserves blocks and tokens for its drafts here; they are
        # proposed for all of them at once after the loop.
        reserved: list[tuple[ScheduledSeq, int]] = []
        speculates = self.proposer is not None and (
            self.disable_speculation_above is None
            or len(self.running) <= self.disable_speculation_above
        )
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            num_drafts = 0
            if speculates and seq.num_uncomputed_tokens == 1:
                num_drafts = self._draft_room(seq, budget - 1)
                num_new += num_drafts
            allocated = self._allocate(seq, num_new)
            while not allocated:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                allocated = self._allocate(seq, num_new)
            if not allocated:
                break
            out.scheduled.append(ScheduledSeq(seq, num_new))
            if num_drafts:
                reserved.append((out.scheduled[-1], num_drafts))
            budget -= num_new
            i += 1
        if reserved:
            budget += self._draft(reserved)
        if out.preempted:
            return out  # no admissions in a step that had to preempt
        if self.policy == "static" and not self.static_batch:
            self.static_batch = {s.request_id for s in list(self.waiting)[: self.max_num_seqs]}
        # Then waiting sequences, first come first served, while budgets and blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.policy == "static" and seq.request_id not in self.static_batch:
                break
            if not any(seq.block_tables):
                seq.num_computed_tokens = seq.num_cached_tokens = self.kv.allocate_prefix(seq)
                if self.tiers is not None and not seq.tiers_looked_up and self._load(seq):
                    continue
            num_new = seq.num_uncomputed_tokens
            if num_new > budget and self.enable_chunked_prefill:
                num_new = budget
            if num_new > budget or not self._allocate(seq, num_new):
                # Give back the prefix blocks it matched: a waiting sequence pins nothing. With
                # nothing running, the blocks are held by handoffs (prefilled sequences waiting
                # to be sent, or reserved for arriving KV) and come back when those end.
                self.kv.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _load(self, seq: Sequence) -> bool:
        """Blocks continuing the head waiting sequence's cached prefix from a lower tier, in
        every KV group: if any, they are allocated and loading, and the sequence waits out of
        the queue."""
        found = self.tiers.find(self.kv, seq, seq.num_tokens)
        if found.hits and not self.kv.allocate_load(seq, found.prefix):
            self.tiers.release(found.hits)  # no room now: looked up again at its next admission
            return False
        self.tiers.count_lookup(found)
        seq.tiers_looked_up = True  # once per admission: a preemption looks again
        if not found.hits:
            return False
        self.waiting.popleft()
        self.loading[seq.request_id] = seq
        self.tiers.load(found.prefix.blocks, found.hits, lambda n: self.loaded(seq, found, n))
        return True

    def loaded(self, seq: Sequence, found: TierLoad, num_loaded: int) -> None:
        """A load ended, its first num_loaded blocks filled: those enter the prefix cache, and
        the sequence returns to the queue's head holding nothing, as every waiting sequence
        (its admission takes them from the prefix cache, as any cached prefix: sequences loaded
        together must not hold the pool while one waits for room). A disk block that failed
        is gone from its tier: the admission looks below again, for the blocks up to it that
        the windows of other groups need. Aborted meanwhile, it frees everything."""
        self.loading.pop(seq.request_id, None)
        if seq.status is not SequenceStatus.FINISHED:
            self.kv.cache_loaded(seq, found.prefix, num_loaded)
            if num_loaded < len(found.hits) and found.hits[num_loaded].tier == "disk":
                seq.tiers_looked_up = False
            self.waiting.appendleft(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def _draft_room(self, seq: Sequence, room: int) -> int:
        """How many drafts a decoding sequence may take: at most num_speculative_tokens, the
        step's room, what its max_tokens and the context leave after the token it samples
        anyway, and what the proposer allows it."""
        left = seq.params.max_tokens - seq.num_output_tokens - 1
        k = min(self.num_speculative_tokens, room, left)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        if k <= 0 or seq.prefill_only:
            return 0
        return min(self.proposer.limit(seq, k), k)

    def _draft(self, reserved: list[tuple[ScheduledSeq, int]]) -> int:
        """Propose the drafts of every sequence that reserved room for them, in one call; give
        back the blocks and tokens of drafts not proposed (each table again holds exactly what
        its tokens need). Returns the tokens given back."""
        drafts = self.proposer.draft([(item.seq, k) for item, k in reserved])
        given_back = 0
        for (item, k), tokens in zip(reserved, drafts):
            seq = item.seq
            seq.draft_token_ids = tokens[:k]
            unused = k - len(seq.draft_token_ids)
            if not unused:
                continue
            item.num_new_tokens -= unused
            given_back += unused
            self.kv.trim(seq, seq.num_computed_tokens + item.num_new_tokens)
        return given_back

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        return self.kv.allocate_slots(
            seq, seq.num_computed_tokens + num_new, seq.num_computed_tokens
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop its KV and requeue it at the front of the waiting line."""
        self.running.remove(seq)
        self.kv.free(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.draft_token_ids = []
        seq.tiers_looked_up = False
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.request_id)

    def postprocess(
        self,
        out: SchedulerOutput,
        sampled: dict[int, int],
        max_model_len: int,
        more: dict[int, list[int]] | None = None,
    ) -> dict[int, int]:
        """Advance computed counts, append sampled tokens (keyed by index in out.scheduled; a
        speculating sequence's tokens after its first, its accepted drafts and the token after
        them, in `more`), register full blocks in the prefix cache, and finish what is done.
        Returns how many tokens each sampling sequence appended (fewer where a stop ends it)."""
        more = more or {}
        appended: dict[int, int] = {}
        for index, item in enumerate(out.scheduled):
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prefill_tokens_computed += item.num_new_tokens
            first = sampled.get(index)
            extra = more.get(index, ())  # as many as the drafts it accepted
            num_drafts = len(seq.draft_token_ids)
            if num_drafts:
                # The rejected drafts' KV is dropped: the tokens it holds are not the sequence's.
                seq.draft_token_ids = []
                accepted = len(extra)
                seq.num_computed_tokens += item.num_new_tokens - num_drafts + accepted
            else:
                seq.num_computed_tokens += item.num_new_tokens
            if first is None:
                self._cache(seq, num_drafts)
                continue
            num_before = seq.num_tokens
            seq.append_token(first)
            reason = seq.check_stop(max_model_len)
            count = 1
            for token in extra:
                if reason is not None:
                    break
                seq.append_token(token)
                reason = seq.check_stop(max_model_len)
                count += 1
            appended[index] = count
            if num_drafts:
                # What the proposer saw past the accepted drafts is not the sequence's.
                valid = min(num_before + len(extra), seq.num_tokens)
                self.proposer.rollback(seq, valid)
                seq.draft_pacing.record(num_drafts, len(extra), seq.num_output_tokens)
            # A stop among the accepted drafts leaves KV past the sequence's last token.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            self._cache(seq, num_drafts)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            elif seq.prefill_only:
                # Its KV leaves for a decode node: out of the batch, blocks kept by the caller.
                self.running.remove(seq)
                seq.status = SequenceStatus.PREFILLED
                self.static_batch.discard(seq.request_id)
        return appended

    def _cache(self, seq: Sequence, num_drafts: int) -> None:
        """Register the sequence's filled blocks and give back those no later query reads;
        after verifying drafts, first give back the blocks that only rejected drafts reached
        (the tables hold what its KV needs, no more)."""
        if num_drafts:
            self.kv.trim(seq, seq.num_computed_tokens)
        self.kv.cache_full_blocks(seq)
        self.kv.release_unread(seq)

    def append_forced(self, seq: Sequence, token_id: int, max_model_len: int) -> None:
        """Append a token the sequence's constraint forces (no step sampled it: its KV is
        computed with the next step's), and finish the sequence if that ends it."""
        seq.append_token(token_id)
        reason = seq.check_stop(max_model_len)
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)
