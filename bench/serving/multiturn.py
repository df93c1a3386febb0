"""A multi-turn chat workload and its client: sessions of several turns, each turn's prompt the
previous turn's prompt and answer plus a new message, sent when the previous turn has ended.

Prompts travel as token ids over the coordinator's client socket (`pdserve serve --client-port`),
so turn N+1 starts with exactly the tokens turn N saw and generated, as a chat frontend that keeps
its conversation as token ids sends them."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.client import CoordinatorClient


@dataclass(slots=True, frozen=True)
class Turn:
    message: list[int]  # the new tokens this turn adds after the history
    output_len: int  # max_tokens, generated in full with ignore_eos


@dataclass(slots=True)
class MultiTurnWorkload:
    """`num_sessions` sessions of `turns` turns (uniform in [lo, hi]); the first message is
    `first_len` tokens, later ones `message_len`; answers `output_len` tokens."""

    num_sessions: int = 8
    turns: tuple[int, int] = (4, 8)
    first_len: tuple[int, int] = (64, 128)
    message_len: tuple[int, int] = (16, 48)
    output_len: tuple[int, int] = (16, 32)
    token_id_range: tuple[int, int] = (10, 500)

    def __post_init__(self) -> None:
        for name in ("turns", "first_len", "message_len", "output_len", "token_id_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {(lo, hi)}")
        if self.num_sessions < 1:
            raise ValueError(f"num_sessions must be at least 1, got {self.num_sessions}")

    def max_prompt_len(self) -> int:
        """The longest prompt a session can reach (its last turn's)."""
        turns = self.turns[1]
        return self.first_len[1] + (turns - 1) * (self.output_len[1] + self.message_len[1])

    def sample(self, seed: int) -> list[list[Turn]]:
        rng = random.Random(seed)
        lo, hi = self.token_id_range

        def tokens(n: int) -> list[int]:
            return [rng.randrange(lo, hi) for _ in range(n)]

        sessions = []
        for _ in range(self.num_sessions):
            n = rng.randint(*self.turns)
            turns = [Turn(tokens(rng.randint(*self.first_len)), rng.randint(*self.output_len))]
            turns += [
                Turn(tokens(rng.randint(*self.message_len)), rng.randint(*self.output_len))
                for _ in range(n - 1)
            ]
            sessions.append(turns)
        return sessions


@dataclass(slots=True)
class TurnResult:
    session: int
    turn: int
    prompt_len: int
    output_len: int
    ttft: float  # seconds from submit to the first token
    first_gap: float  # seconds from the first token to the second (the KV handoff's share)
    latency: float  # seconds from submit to the last token
    output: list[int] = field(default_factory=list)


async def run_session(client: CoordinatorClient, index: int, turns: list[Turn]) -> list[TurnResult]:
    """One session's turns in order, each after the previous one ended."""
    history: list[int] = []
    results = []
    for t, turn in enumerate(turns):
        prompt = history + turn.message
        params = SamplingParams(max_tokens=turn.output_len, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        stamps: list[float] = []
        output: list[int] = []
        async for event in client.generate(prompt, params):
            if event.error is not None:
                raise RuntimeError(f"session {index} turn {t}: {event.error}")
            if event.token_ids:
                stamps += [time.perf_counter()] * len(event.token_ids)
                output += event.token_ids
        end = time.perf_counter()
        results.append(
            TurnResult(
                index,
                t,
                len(prompt),
                len(output),
                ttft=stamps[0] - start,
                first_gap=stamps[1] - stamps[0] if len(stamps) > 1 else 0.0,
                latency=end - start,
                output=output,
            )
        )
        history = prompt + output
    return results


async def run_sessions(
    address: str, sessions: list[list[Turn]], concurrency: int
) -> list[TurnResult]:
    """Every session, `concurrency` of them at a time, over one client socket."""
    cap = asyncio.Semaphore(concurrency)
    async with CoordinatorClient(address) as client:

        async def one(index: int, turns: list[Turn]) -> list[TurnResult]:
            async with cap:
                return await run_session(client, index, turns)

        done = await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
    return [r for session in done for r in session]
