"""The time of one engine step, from what the scheduler put in it: the simulator's stand-in for the
model forward and the sampler.

A step is described by its `StepShape` (sequences, new tokens, attention pairs, KV read, sampled
rows) and costs

    time = base + per_seq * seqs + combine(compute, memory)
    compute = per_token * tokens + per_pair * pairs + per_row * sampled rows
    memory = weights + routed experts' weights * touched(tokens) + per_context * KV tokens read

where `combine` is a sum (`overlap = False`, a CPU, fitted from measured steps) or a max
(`overlap = True`, a roofline: compute and memory traffic overlap on a GPU). A tensor-parallel
node adds its all-reduces after that, `allreduce_per_token * tokens` (their bytes; their
latencies are in `base`): a layer waits for its all-reduce, which overlaps nothing.

In a mixture of experts a step reads only the experts its tokens are routed to: with E experts,
k per token and routing taken as uniform, the expected fraction touched by n tokens is
1 - (1 - k/E)^n, a few experts for one decode token and all of them for a prefill.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from pdserve.engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    num_seqs: int  # sequences in the step (each decode and each prefill chunk)
    num_tokens: int  # new tokens: the chunks' lengths, one per decode
    num_pairs: float  # (query token, key token) pairs attention computes, causal
    num_context: int  # KV tokens read: each sequence's context and its new tokens
    num_rows: int  # sequences that sample a token (their chunk reaches their end)

    @classmethod
    def of(cls, out: SchedulerOutput, rows: list[int] | None = None) -> StepShape:
        """The shape of a scheduled step; `rows` gets the indices of the sequences that sample
        (their chunk reaches their end, as ModelRunner.prepare picks them)."""
        seqs = tokens = context = 0
        pairs = 0.0
        sampled = [] if rows is None else rows
        for index, item in enumerate(out.scheduled):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            seqs += 1
            tokens += n
            context += start + n
            pairs += n * (start + (n + 1) / 2)
            if start + n == seq.num_tokens:
                sampled.append(index)
        return cls(seqs, tokens, pairs, context, len(sampled))

    @classmethod
    def prefill(cls, prompts: int, length: int, context: int = 0) -> StepShape:
        """`prompts` chunks of `length` new tokens each after `context` computed ones, ending
        their prompts."""
        pairs = prompts * length * (context + (length + 1) / 2)
        return cls(prompts, prompts * length, pairs, prompts * (context + length), prompts)

    @classmethod
    def decode(cls, batch: int, context: int) -> StepShape:
        """`batch` sequences of `context` tokens each taking one new token."""
        return cls(batch, batch, batch * (context + 1), batch * (context + 1), batch)

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


# Names of the linear coefficients, in the order of `StepTimeModel.features`.
TERMS = ("base_s", "per_seq_s", "per_token_s", "per_pair_s", "per_row_s", "per_context_s")


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_row_s: float = 0.0
    per_context_s: float = 0.0
    weights_s: float = 0.0  # reading the weights once per step
    overlap: bool = False  # compute and memory overlap (max) instead of adding up
    allreduce_per_token_s: float = 0.0  # a tensor-parallel group's all-reduces, per new token
    expert_weights_s: float = 0.0  # reading every routed expert once (a mixture of experts)
    num_experts: int = 0
    experts_per_token: int = 0

    def experts_touched(self, num_tokens: int) -> float:
        """The expected fraction of the routed experts that `num_tokens` tokens use."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** num_tokens

    def time(self, shape: StepShape) -> float:
        compute = (
            self.per_token_s * shape.num_tokens
            + self.per_pair_s * shape.num_pairs
            + self.per_row_s * shape.num_rows
        )
        memory = self.weights_s + self.per_context_s * shape.num_context
        if self.expert_weights_s:
            memory += self.expert_weights_s * self.experts_touched(shape.num_tokens)
        both = max(compute, memory) if self.overlap else compute + memory
        allreduce = self.allreduce_per_token_s * shape.num_tokens
        return self.base_s + self.per_seq_s * shape.num_seqs + both + allreduce

    @staticmethod
    def features(shape: StepShape) -> list[float]:
        return [
            1.0,
            shape.num_seqs,
            shape.num_tokens,
            shape.num_pairs,
            shape.num_rows,
            shape.num_context,
        ]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepTimeModel:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def fit(shapes: list[StepShape], seconds: list[float]) -> StepTimeModel:
    """The additive model closest to measured steps in relative error (every coefficient >= 0,
    so a step never costs less for holding more)."""
    a = np.array([StepTimeModel.features(s) for s in shapes], dtype=float)
    y = np.asarray(seconds, dtype=float)
    weights = 1.0 / y  # relative error: a 5 ms decode step counts as much as a 300 ms prefill
    # Columns scaled to unit norm so the solver's tolerance means the same for every term.
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    coef = nnls((a * weights[:, None]) / scale, y * weights) / scale
    return StepTimeModel(**dict(zip(TERMS, coef.tolist())))


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter or 3 * n):
        gradient = a.T @ (b - a @ x)
        candidates = ~passive & (gradient > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back to the boundary and drop the coefficients that reached zero.
            shrinking = passive & (z <= 0)
            alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x
