"""What one SIGKILL of `pdserve.bench.recovery` gives: each request in flight, whether the kill
moved it, how long until it was served again and whether it ended with the offline engine's
tokens; the workload every kill sends; the summary of a kind's kills."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass, field

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.embedded.catalog import resolve_model_dir

KINDS = ("decode", "prefill", "coordinator", "tp-rank")
AIM_S = {"decode": 2.0, "prefill": 2.0, "coordinator": 5.0, "tp-rank": 2.0}  # issue 33's aims
LABELS = {
    "decode": "decode node",
    "prefill": "prefill node",
    "coordinator": "coordinator (`pdserve launch`)",
    "tp-rank": "rank 1 of a TP=2 decode node",
}
MIN_OUTPUTS = 3  # tokens every stream has before a decode-side kill: it lands mid-output
POLL_S = 0.002


# --- what one kill gives ---------------------------------------------------------------------


@dataclass(slots=True)
class RequestOutcome:
    """One request of one kill: whether the kill moved it, when it was served again, how it
    ended."""

    request_id: str
    prompt: list[int]
    affected: bool = False
    tokens_before_kill: int = 0
    recovery_s: float | None = None  # kill -> its first token after the kill (affected only)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None  # failed, or not the offline engine's tokens

    def summary(self) -> dict:
        d = asdict(self)
        del d["prompt"], d["tokens"]
        return d | {"prompt_tokens": len(self.prompt), "output_tokens": len(self.tokens)}


@dataclass(slots=True)
class Kill:
    kind: str
    repeat: int
    victim: str  # node id, "rank 1 of <node id>", or "coordinator"
    requests: list[RequestOutcome]
    # Where the time went (seconds after the kill), where this bench can see it.
    stages: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None  # the kill itself could not be made or measured

    @property
    def affected(self) -> list[RequestOutcome]:
        return [r for r in self.requests if r.affected]

    @property
    def failed(self) -> list[RequestOutcome]:
        return [r for r in self.requests if r.error is not None]

    def summary(self) -> dict:
        return {
            "kind": self.kind,
            "repeat": self.repeat,
            "victim": self.victim,
            "stages": self.stages,
            "error": self.error,
            "requests": [r.summary() for r in self.requests],
        }


@dataclass(slots=True)
class KindSummary:
    kind: str
    kills: int
    affected: int
    p50_s: float | None
    max_s: float | None
    failed: list[str]  # "request: why", and kills that could not be made
    aim_s: float
    stages_p50_s: dict[str, float]

    @property
    def measured(self) -> bool:
        return self.p50_s is not None

    @property
    def aim_met(self) -> bool:
        return self.max_s is not None and self.max_s < self.aim_s


def summarize(kind: str, kills: list[Kill]) -> KindSummary:
    """P50 and max over every affected request of every kill; every failure named."""
    times = [r.recovery_s for k in kills for r in k.affected if r.recovery_s is not None]
    failed = [f"{k.kind}#{k.repeat}: {k.error}" for k in kills if k.error]
    failed += [f"{r.request_id}: {r.error}" for k in kills for r in k.failed]
    stages: dict[str, float] = {}
    for name in dict.fromkeys(s for k in kills for s in k.stages):
        values = [k.stages[name] for k in kills if k.stages.get(name) is not None]
        if values:
            stages[name] = round(statistics.median(values), 3)
    return KindSummary(
        kind,
        len(kills),
        sum(len(k.affected) for k in kills),
        round(statistics.median(times), 3) if times else None,
        round(max(times), 3) if times else None,
        failed,
        AIM_S[kind],
        stages,
    )


def check_tokens(outcome: RequestOutcome, expected: list[int]) -> None:
    """A request that ended without error must have streamed exactly the offline tokens."""
    if outcome.error is not None or outcome.tokens == expected:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(outcome.tokens, expected)) if a != b),
        min(len(outcome.tokens), len(expected)),
    )
    outcome.error = (
        f"tokens differ from the offline engine's at index {at} "
        f"({len(outcome.tokens)} streamed, {len(expected)} expected)"
    )


# --- the workload ------------------------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    """The prompts of every kill and their offline (greedy) outputs."""

    model: str
    requests: int
    max_tokens: int
    seed: int
    expected: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)

    def prompts(self, kind: str, repeat: int) -> list[list[int]]:
        """Short prompts, or for a prefill kill long ones (their prefill takes long enough to
        be killed under it)."""
        rng = random.Random(f"{self.seed}:{kind}:{repeat}")
        if kind == "prefill":
            hi = max_model_len(self.model) - self.max_tokens - 1
            lo, hi = min(600, hi // 2), min(900, hi)
        else:
            lo, hi = 16, 64
        return [
            [rng.randrange(4, 500) for _ in range(rng.randrange(lo, hi + 1))]
            for _ in range(self.requests)
        ]

    def compute(self, prompts: list[list[int]], engine: EngineConfig) -> None:
        from pdserve.engine import LLM

        todo = [p for p in prompts if tuple(p) not in self.expected]
        if not todo:
            return
        options = {
            k: getattr(engine, k)
            for k in ("block_size", "dtype", "max_num_batched_tokens", "kv_cache_bytes")
        }
        with LLM(self.model, device="cpu", **options) as llm:
            for prompt, out in zip(todo, llm.generate(todo, self.params)):
                self.expected[tuple(prompt)] = out.token_ids

    def of(self, prompt: list[int]) -> list[int]:
        return self.expected[tuple(prompt)]


def max_model_len(model: str) -> int:
    config = json.loads((resolve_model_dir(model) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


# --- output ------------------------------------------------------------------------------------


def describe_kill(kill: Kill) -> str:
    if kill.error:
        return f"{kill.kind} #{kill.repeat}: not measured: {kill.error}"
    times = sorted(r.recovery_s for r in kill.affected if r.recovery_s is not None)
    stages = ", ".join(f"{k} {v}" for k, v in kill.stages.items())
    shown = " ".join(f"{t:.2f}" for t in times)
    return (
        f"{kill.kind} #{kill.repeat}: killed {kill.victim}; {len(kill.affected)} of "
        f"{len(kill.requests)} requests affected, recovered in [{shown}] s; "
        f"{len(kill.failed)} failed; {stages}"
    )
