"""Iteration-level scheduling: each step, one batch of running decodes and prefill chunks within
`max_num_seqs` and `max_num_batched_tokens`; preemption by recompute when blocks run out.

The scheduler decides (which sequences, how many tokens, which blocks); the model runner
executes. Two admission policies share the step loop: `continuous` admits waiting requests
whenever there is room; `static` forms a batch and admits nothing new until all of it finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # a chunk reaching the end of the sequence samples a token after it


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
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is preempted first
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
        return len(self.waiting) + len(self.running)

    def abort(self, request_id: str) -> Sequence | None:
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
        self.block_manager.free(seq.block_table)
        self.static_batch.discard(seq.request_id)

    # --- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        # Running sequences first, oldest first, so the oldest is never starved.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
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
            budget -= num_new
            i += 1
        if out.preempted:
            return out  # no admissions in a step that had to preempt
        if self.policy == "static" and not self.static_batch:
            self.static_batch = {s.request_id for s in list(self.waiting)[: self.max_num_seqs]}
        # Then waiting sequences, first come first served, while budgets and blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.policy == "static" and seq.request_id not in self.static_batch:
                break
            if not seq.block_table:
                seq.block_table = bm.allocate_prefix(seq.token_ids)
                seq.num_computed_tokens = seq.num_cached_tokens = (
                    len(seq.block_table) * bm.block_size
                )
            num_new = seq.num_uncomputed_tokens
            if num_new > budget and self.enable_chunked_prefill:
                num_new = budget
            if num_new > budget or not self._allocate(seq, num_new):
                # Give back the prefix blocks it matched: a waiting sequence pins nothing. With
                # nothing running, the blocks are held by handoffs (prefilled sequences waiting
                # to be sent, or reserved for arriving KV) and come back when those end.
                bm.free(seq.block_table)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        return self.block_manager.allocate_slots(
            seq.block_table, seq.num_computed_tokens + num_new, seq.num_computed_tokens
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop its KV and requeue it at the front of the waiting line."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.request_id)

    def postprocess(
        self, out: SchedulerOutput, sampled: dict[int, int], max_model_len: int
    ) -> None:
        """Advance computed counts, append sampled tokens (keyed by index in out.scheduled),
        register full blocks in the prefix cache, and finish what is done."""
        for index, item in enumerate(out.scheduled):
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prefill_tokens_computed += item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(
                seq.block_table, seq.token_ids, seq.num_computed_tokens
            )
            if index not in sampled:
                continue
            seq.append_token(sampled[index])
            reason = seq.check_stop(max_model_len)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            elif seq.prefill_only:
                # Its KV leaves for a decode node: out of the batch, blocks kept by the caller.
                self.running.remove(seq)
                seq.status = SequenceStatus.PREFILLED
                self.static_batch.discard(seq.request_id)

    def append_forced(self, seq: Sequence, token_id: int, max_model_len: int) -> None:
        """Append a token the sequence's constraint forces (no step sampled it: its KV is
        computed with the next step's), and finish the sequence if that ends it."""
        seq.append_token(token_id)
        reason = seq.check_stop(max_model_len)
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)
