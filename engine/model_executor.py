"""What runs one scheduled step on a device: the model forward over its tokens, then sampling
(`ModelExecutor`); the engine hands it each step, and a tensor-parallel node's rank 0 uses
`TPExecutor`, which first publishes the step to the other ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import sample
from pdserve.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepStats:
    num_steps: int = 0
    num_tokens: int = 0
    forward_s: float = 0.0
    total_s: float = 0.0
    num_forced_tokens: int = 0  # appended without a step of their own (forced_tokens)


@dataclass(slots=True)
class SampledTokens:
    """What executing one step produced: a token for each sequence whose chunk reached its end."""

    rows: list[int]  # indices into SchedulerOutput.scheduled, in order
    token_ids: list[int]
    logprobs: list[dict | None]


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
        result = sample(logits, [out.scheduled[i].seq for i in rows])
        return SampledTokens(rows, result.token_ids, result.logprobs)

    def forward(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        return self.runner.run(out)

    def close(self) -> None:
        pass
