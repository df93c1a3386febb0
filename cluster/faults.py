"""Faults injected on purpose, to prove that nothing at a seam of the cluster yields a wrong token,
a stuck request or a stranded KV block: off unless the environment variable PDSERVE_FAULTS names
some, e.g. `drop=0.02,duplicate=0.02,seed=7`. Every pdserve process reads it (a node inherits
its launcher's environment).

Message faults, each with the probability that one message a socket receives suffers it (at
most one fault per message):

- `drop`: the message is lost;
- `delay`: it arrives `delay_ms` later (default 50), after the messages behind it;
- `duplicate`: it arrives twice;
- `reorder`: it arrives after the next message (or `delay_ms` later if none comes);
- `truncate`: its last frame loses its tail;
- `corrupt`: one bit of one frame flips (also of a KV page as it lands: kv_transfer.faults).

They are applied where a socket's messages are received, before anything reads them, on the node
link (coordinator and nodes, both ways), a prefill node's handoff socket and the KV transfers'
control sockets, so what copes with them is the production code: the codec's digests, the link
sessions' acknowledgements and resends (`cluster/link_session.py`), the KV transfers' timeouts.

Process faults, each with the probability per engine step of a node:

- `stall`: the node stops for `stall_ms` (default 1000): a long GC pause, a swapped-out page;
- `kill`: the node dies at once (SIGKILL): its supervisor starts it afresh.

A seed (`seed=N`, default 0) makes the faults of each socket and process reproducible.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ENV = "PDSERVE_FAULTS"
MESSAGE_FAULTS = ("drop", "delay", "duplicate", "reorder", "truncate", "corrupt")
PROCESS_FAULTS = ("stall", "kill")
FAULTS = MESSAGE_FAULTS + PROCESS_FAULTS
FAULTS_POLL_MS = 10  # how long a thread that receives with faults waits, at most, in a poll


@dataclass(slots=True)
class FaultPlan:
    """The faults configured: a rate per kind, the seed, and how long a delay and a stall last."""

    rates: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    delay_ms: float = 50.0
    stall_ms: float = 1000.0

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """`drop=0.02,delay=0.01,delay_ms=80,seed=7`: ValueError naming a part it cannot read."""
        plan = cls()
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            try:
                if key in FAULTS:
                    rate = float(value)
                    if not 0.0 <= rate <= 1.0:
                        raise ValueError
                    plan.rates[key] = rate
                elif key == "seed":
                    plan.seed = int(value)
                elif key in ("delay_ms", "stall_ms"):
                    setattr(plan, key, float(value))
                    if getattr(plan, key) < 0:
                        raise ValueError
                else:
                    raise KeyError
            except (KeyError, ValueError):
                raise ValueError(
                    f"{ENV}: cannot read {part!r} (known: {'=P, '.join(FAULTS)}=P with P in "
                    "[0, 1], seed=N, delay_ms=MS, stall_ms=MS)"
                ) from None
        if sum(plan.rates.get(k, 0.0) for k in MESSAGE_FAULTS) > 1.0:
            raise ValueError(f"{ENV}: the message faults' rates add up to more than 1")
        return plan

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        text = os.environ.get(ENV, "")
        return cls.parse(text) if text else None

    def rng(self, where: str) -> random.Random:
        """A generator of its own for each socket or process, from the seed and its name."""
        return random.Random(f"{self.seed}:{where}")


def message_faults(where: str) -> MessageFaults | None:
    """The message faults of the socket named `where`, or None when none are configured."""
    plan = _plan_for(MESSAGE_FAULTS, where)
    return None if plan is None else MessageFaults(plan, where)


def process_faults(where: str) -> ProcessFaults | None:
    """The process faults of the node named `where`, or None when none are configured."""
    plan = _plan_for(PROCESS_FAULTS, where)
    return None if plan is None else ProcessFaults(plan, where)


def _plan_for(kinds: tuple[str, ...], where: str) -> FaultPlan | None:
    """The configured plan if it has a fault of `kinds` (logged: the chaos soak looks for it)."""
    plan = FaultPlan.from_env()
    if plan is None or not any(plan.rates.get(k) for k in kinds):
        return None
    logger.warning("%s: injecting faults %s (%s)", where, plan.rates, ENV)
    return plan


class MessageFaults:
    """What one socket receives, as the faults leave it: `arrive(frames)` for each message read
    from the socket, `due()` now and then (a delayed or held message comes out of one or the
    other). Frames are bytes or zmq.Frame; a changed one comes back as the kind it was."""

    def __init__(self, plan: FaultPlan, where: str) -> None:
        self.plan = plan
        self.where = where
        self._rng = plan.rng(where)
        self._delayed: deque[tuple[float, list]] = deque()  # (due, frames), in due order
        self._held: tuple[float, list] | None = None  # (due, frames) of a reordered message
        self.injected: Counter[str] = Counter()

    def arrive(self, frames: list, skip: int = 0, now: float | None = None) -> list[list]:
        """The messages to read now, for one message received: frames[:skip] (a routing id) are
        never changed."""
        now = time.monotonic() if now is None else now
        kind = self._draw()
        out: list[list] = []
        if kind is None:
            out.append(frames)
        elif kind == "drop":
            pass
        elif kind == "delay":
            self._delayed.append((now + self.plan.delay_ms / 1000, frames))
        elif kind == "duplicate":
            out += [frames, frames]
        elif kind == "reorder":
            if self._held is None:
                self._held = (now + self.plan.delay_ms / 1000, frames)
            else:  # one is held already: this one overtakes it
                out.append(frames)
        elif kind == "truncate":
            out.append(self._truncated(frames, skip))
        elif kind == "corrupt":
            out.append(self._corrupted(frames, skip))
        if kind is not None:
            self.injected[kind] += 1
        if self._held is not None and (kind != "reorder" or out):
            out.append(self._held[1])  # after the message that overtook it
            self._held = None
        return out + self.due(now)

    def due(self, now: float | None = None) -> list[list]:
        """Messages whose delay has passed (and one held for a reorder that nothing overtook)."""
        now = time.monotonic() if now is None else now
        out = []
        while self._delayed and self._delayed[0][0] <= now:
            out.append(self._delayed.popleft()[1])
        if self._held is not None and self._held[0] <= now:
            out.append(self._held[1])
            self._held = None
        return out

    def _draw(self) -> str | None:
        r = self._rng.random()
        for kind in MESSAGE_FAULTS:
            r -= self.plan.rates.get(kind, 0.0)
            if r < 0:
                return kind
        return None

    def _truncated(self, frames: list, skip: int) -> list:
        if len(frames) <= skip:
            return frames
        last = _bytes(frames[-1])
        cut = last[: self._rng.randrange(len(last))] if last else last
        return [*frames[:-1], _like(frames[-1], cut)]

    def _corrupted(self, frames: list, skip: int) -> list:
        sizes = [len(_bytes(f)) for f in frames[skip:]]
        if not sum(sizes):
            return frames
        index = self._rng.randrange(sum(sizes))
        out = list(frames)
        for i, size in enumerate(sizes, start=skip):
            if index < size:
                changed = bytearray(_bytes(frames[i]))
                changed[index] ^= 1 << self._rng.randrange(8)
                out[i] = _like(frames[i], bytes(changed))
                return out
            index -= size
        return out


class ProcessFaults:
    """A node's own faults, drawn once per engine step."""

    def __init__(self, plan: FaultPlan, where: str) -> None:
        self.plan = plan
        self.where = where
        self._rng = plan.rng(where + f":{os.getpid()}")  # a restarted node draws anew

    def step(self) -> None:
        r = self._rng.random()
        if r < self.plan.rates.get("kill", 0.0):
            logger.warning("%s: killed by an injected fault (%s)", self.where, ENV)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        elif r < self.plan.rates.get("kill", 0.0) + self.plan.rates.get("stall", 0.0):
            logger.warning(
                "%s: stalled %g ms by an injected fault (%s)", self.where, self.plan.stall_ms, ENV
            )
            time.sleep(self.plan.stall_ms / 1000)


def _like(frame: object, data: bytes) -> object:
    """data as the kind of frame `frame` is (bytes, or a zmq.Frame)."""
    return data if isinstance(frame, bytes) else type(frame)(data)


def _bytes(frame: object) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(getattr(frame, "bytes", frame))
