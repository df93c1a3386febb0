"""What runs one scheduled step on a device: the model forward over its tokens, then sampling
(`ModelExecutor`); the engine hands it each step, and a tensor-parallel node's rank 0 uses
`TPExecutor`, which first publishes the step to the other ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.engine.execution.runner import ModelRunner
from pdserve.engine.sampler import sample
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.spec_decode.speculation import VerifiedRow, accepted


@dataclass(slots=True)
class StepStats:
    num_steps: int = 0
    num_tokens: int = 0
    forward_s: float = 0.0
    total_s: float = 0.0
    num_forced_tokens: int = 0  # appended without a step of their own (forced_tokens)
    num_draft_tokens: int = 0  # proposed by speculative decoding and verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # by position among drafts

    def count_speculation(self, sampled: SampledTokens) -> None:
        self.num_draft_tokens += sampled.num_drafts
        self.num_accepted_tokens += sampled.num_accepted
        # A row's tokens after its first are as many as the drafts it accepted (the accepted
        # drafts are its first tokens, the target's own token after them its last).
        for more in sampled.more_tokens.values():
            grow = len(more) - len(self.accepted_per_position)
            if grow > 0:
                self.accepted_per_position.extend([0] * grow)
            for position in range(len(more)):
                self.accepted_per_position[position] += 1


@dataclass(slots=True)
class SampledTokens:
    """What executing one step produced: a token for each sequence whose chunk reached its end
    (for a speculating sequence, its accepted drafts and the token after them)."""

    rows: list[int]  # indices into SchedulerOutput.scheduled, in order
    token_ids: list[int]  # each row's (first) token
    logprobs: list[dict | None]
    # Speculating rows' tokens after the first (their accepted drafts and the one after): by row
    more_tokens: dict[int, list[int]] = field(default_factory=dict)
    num_drafts: int = 0  # draft tokens verified in the step
    num_accepted: int = 0  # of those, accepted


class Executor(Protocol):
    """Runs one scheduled step: the model forward over its tokens, then sampling."""

    def execute(self, out: SchedulerOutput) -> SampledTokens: ...


class ModelExecutor:
    """The model runner and the sampler, on the model's device."""

    def __init__(self, runner: ModelRunner, stats: StepStats) -> None:
        self.runner = runner
        self.stats = stats

    def execute(self, out: SchedulerOutput) -> SampledTokens:
        t0 = time.perf_counter()
        logits, rows = self.forward(out)
        # On a GPU this is launch time: the sampler's copy of the token ids waits for the kernels.
        self.stats.forward_s += time.perf_counter() - t0
        if not rows:
            return SampledTokens(rows, [], [])
        seqs = [out.scheduled[i].seq for i in rows]
        if logits.shape[0] == len(rows):
            result = sample(logits, seqs)
            return SampledTokens(rows, result.token_ids, result.logprobs)
        return verify(logits, rows, seqs)

    def forward(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        return self.runner.run(out)

    def close(self) -> None:
        pass


def verify(logits: torch.Tensor, rows: list[int], seqs: list) -> SampledTokens:  # noqa: ANN001
    """Sample every scored position (a speculating sequence's next token and each of its drafts,
    each as plain decoding would sample it) and keep each sequence's drafts up to the first the
    samples disagree with."""
    sampled_as = []
    for seq in seqs:
        if not seq.draft_token_ids:
            sampled_as.append(seq)
            continue
        first = seq.sample_index
        for j in range(len(seq.draft_token_ids) + 1):
            sampled_as.append(VerifiedRow(seq.params, first + j))
    result = sample(logits, sampled_as)
    tokens, logprobs, more = [], [], {}
    num_drafts = num_accepted = 0
    at = 0
    for row, seq in zip(rows, seqs):
        drafts = seq.draft_token_ids
        samples = result.token_ids[at : at + len(drafts) + 1]
        kept = accepted(drafts, samples)
        tokens.append(kept[0])
        logprobs.append(result.logprobs[at])
        if len(kept) > 1:
            more[row] = kept[1:]
        num_drafts += len(drafts)
        num_accepted += len(kept) - 1
        at += len(drafts) + 1
    return SampledTokens(rows, tokens, logprobs, more, num_drafts, num_accepted)
