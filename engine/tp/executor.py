"""The executor of a tensor-parallel node, on rank 0: each step's plan goes to the other ranks,
then rank 0 runs the same forward on its own shard and samples from the gathered logits."""

from __future__ import annotations

import torch

from pdserve.engine.execution.executor import ModelExecutor, StepStats
from pdserve.engine.execution.runner import ModelRunner
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.tp.ranks import RankProcesses


class TPExecutor(ModelExecutor):
    def __init__(self, runner: ModelRunner, stats: StepStats, ranks: RankProcesses) -> None:
        super().__init__(runner, stats)
        self.ranks = ranks

    def forward(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        plan = self.runner.prepare(out)
        self.ranks.publish(plan)
        try:
            return self.runner.run_plan(plan)
        except RuntimeError as exc:  # a collective failed: a rank died
            raise self.ranks.failure(exc) from exc

    def close(self) -> None:
        self.ranks.stop()
