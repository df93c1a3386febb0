"""What the tuner serves: requests (prompt length, output length, optionally a shared prefix) and
when they arrive, from synthetic length distributions, a trace file or a ShareGPT file.

A `Workload` holds the lengths and the arrival process at a rate of one request per second, so
that the same requests come at any rate (`at_rate`): the search compares rates on identical
draws. Arrivals are gamma-distributed gaps with mean 1/rate, shape `burstiness` (1 = Poisson), as
a real load draws them (`tune/arrivals.py`); a trace keeps its own times,
compressed or stretched to the rate.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    prompt_len: int
    output_len: int  # max_tokens, generated in full (ignore_eos)
    prompt: tuple[int, ...] | None = None  # the token ids; None: drawn at random
    prefix_group: int | None = None  # requests of one group share their first prefix_len tokens
    prefix_len: int = 0


@dataclass(frozen=True, slots=True)
class LengthDist:
    """`N` (fixed), `LO:HI` (uniform integers), or `lognormal:MEDIAN:SIGMA[:MAX]` (rounded,
    clipped to [1, MAX])."""

    kind: str
    a: float
    b: float = 0.0
    limit: int | None = None

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.split(":")
        try:
            if parts[0] == "lognormal":
                if len(parts) not in (3, 4):
                    raise ValueError
                limit = int(parts[3]) if len(parts) == 4 else None
                dist = cls("lognormal", float(parts[1]), float(parts[2]), limit)
            elif len(parts) == 1:
                dist = cls("uniform", int(parts[0]), int(parts[0]))
            elif len(parts) == 2:
                dist = cls("uniform", int(parts[0]), int(parts[1]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"length {text!r}: give N, LO:HI or lognormal:MEDIAN:SIGMA[:MAX]"
            ) from None
        if dist.kind == "uniform" and not 1 <= dist.a <= dist.b:
            raise ValueError(f"length {text!r}: need 1 <= LO <= HI")
        if dist.kind == "lognormal" and (dist.a < 1 or dist.b < 0):
            raise ValueError(f"length {text!r}: need MEDIAN >= 1 and SIGMA >= 0")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=n)
        values = np.rint(rng.lognormal(math.log(self.a), self.b, size=n))
        return np.clip(values, 1, self.limit or np.inf).astype(int)

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a * math.exp(self.b**2 / 2)  # before clipping

    def __str__(self) -> str:
        if self.kind == "uniform":
            return f"{self.a:g}" if self.a == self.b else f"{self.a:g}:{self.b:g}"
        return f"lognormal:{self.a:g}:{self.b:g}" + (f":{self.limit}" if self.limit else "")


@dataclass(slots=True)
class Workload:
    """Requests at one request per second: `offsets` are their arrival times at that rate."""

    requests: list[SimRequest]  # arrival_s unused; see offsets
    offsets: np.ndarray
    description: str
    trace_rate: float | None = None  # a trace's own rate (its times are kept in shape)
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, n: int) -> Workload:
        """The first n requests."""
        if n >= len(self.requests):
            return self
        return replace(self, requests=self.requests[:n], offsets=self.offsets[:n])

    def at_rate(self, rate: float) -> list[SimRequest]:
        return [replace(r, arrival_s=float(t) / rate) for r, t in zip(self.requests, self.offsets)]

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean([r.prompt_len for r in self.requests]))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean([r.output_len for r in self.requests]))

    def prompt_len_quantile(self, q: float) -> int:
        return int(np.quantile([r.prompt_len for r in self.requests], q))

    def uncached_len_quantile(self, q: float) -> int | None:
        """Of the prompts that share a prefix with others, the tokens after it (None: none
        shares one)."""
        rest = [r.prompt_len - r.prefix_len for r in self.requests if r.prefix_group is not None]
        return int(np.quantile(rest, q)) if rest else None


def unit_offsets(n: int, burstiness: float, seed: int) -> np.ndarray:
    """Arrival times at one request per second; the first at 0."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n)
    return np.cumsum(gaps) - gaps[0] if n else gaps


def synthetic(
    num_requests: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    *,
    long_fraction: float = 0.0,
    long_prompt_len: LengthDist | None = None,
    long_output_len: LengthDist | None = None,
    shared_prefix_len: int = 0,
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Lengths from the distributions; `long_fraction` of the requests, at seeded random places,
    from the long ones instead. With `shared_prefix_len`, every prompt starts with the same tokens
    (a system prompt), which prefix caching can reuse."""
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_len.sample(rng, num_requests), output_len.sample(rng, num_requests)
    is_long = np.zeros(num_requests, dtype=bool)
    if long_fraction > 0:
        if long_prompt_len is None or long_output_len is None:
            raise ValueError("a long fraction needs long prompt and output lengths")
        is_long[rng.choice(num_requests, round(num_requests * long_fraction), replace=False)] = True
        prompts[is_long] = long_prompt_len.sample(rng, int(is_long.sum()))
        outputs[is_long] = long_output_len.sample(rng, int(is_long.sum()))
    group = 0 if shared_prefix_len else None
    requests = [
        SimRequest(0.0, int(p) + shared_prefix_len, int(o), None, group, shared_prefix_len)
        for p, o in zip(prompts, outputs)
    ]
    text = f"prompts {prompt_len}, outputs {output_len}"
    if long_fraction:
        text += f"; {long_fraction:.0%} long: prompts {long_prompt_len}, outputs {long_output_len}"
    if shared_prefix_len:
        text += f"; a {shared_prefix_len}-token prefix shared by all"
    offsets = unit_offsets(num_requests, burstiness, seed + 1)
    return Workload(requests, offsets, f"synthetic ({text}), burstiness {burstiness:g}")


def load_trace(path: str | Path) -> Workload:
    """A CSV (with a header) or JSON-lines file of arrival_s, prompt_len, output_len and,
    optionally, prefix_group and prefix_len (requests of a group share that many first tokens)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ValueError(f"{path}: no requests")
    requests, times = [], []
    for i, row in enumerate(rows):
        try:
            times.append(float(row["arrival_s"]))
            group = row.get("prefix_group")
            requests.append(
                SimRequest(
                    0.0,
                    int(row["prompt_len"]),
                    int(row["output_len"]),
                    prefix_group=None if group in (None, "") else int(group),
                    prefix_len=int(row.get("prefix_len") or 0),
                )
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(
                f"{path}: request {i + 1}: needs arrival_s, prompt_len, output_len ({exc})"
            ) from None
    order = np.argsort(times, kind="stable")
    times_arr = np.asarray(times)[order]
    requests = [requests[i] for i in order]
    offsets, rate = _at_one_per_second(times_arr)
    return Workload(requests, offsets, f"trace {path.name}", trace_rate=rate)


def _at_one_per_second(times: np.ndarray) -> tuple[np.ndarray, float]:
    """Sorted arrival times (s) as offsets at one request per second, and their own rate."""
    span = times[-1] - times[0] if len(times) else 0.0
    rate = (len(times) - 1) / span if span > 0 else 1.0
    return (times - times[0]) * rate, rate


def approximate_token_count(text: str) -> int:
    """About four characters a token, for English with a BPE tokenizer."""
    return max(1, len(text) // 4)


def token_counter(model_dir: str | Path | None) -> Callable[[str], int]:
    """The model's tokenizer where its directory holds one, else the approximation."""
    path = Path(model_dir) / "tokenizer.json" if model_dir else None
    if path is None or not path.is_file():
        return approximate_token_count
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def load_sharegpt(
    path: str | Path,
    num_requests: int,
    count_tokens: Callable[[str], int] = approximate_token_count,
    *,
    burstiness: float = 1.0,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    min_len: int = 4,
) -> Workload:
    """The first human turn of each conversation as the prompt and the reply's length as the
    output length, conversations too short or too long skipped, drawn in seeded order: the
    load generator's filter (`pdserve.tune.serving_workload.load_sharegpt`)."""
    data = json.loads(Path(path).read_text())
    rng = np.random.default_rng(seed)
    requests: list[SimRequest] = []
    for i in rng.permutation(len(data)):
        turns = data[i].get("conversations") or data[i].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt_len = count_tokens(turns[0].get("value", ""))
        output_len = count_tokens(turns[1].get("value", ""))
        if prompt_len < min_len or output_len < min_len:
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        requests.append(SimRequest(0.0, prompt_len, output_len))
        if len(requests) == num_requests:
            break
    if len(requests) < num_requests:
        raise ValueError(
            f"{path}: only {len(requests)} usable conversations, {num_requests} wanted"
        )
    offsets = unit_offsets(num_requests, burstiness, seed + 1)
    return Workload(requests, offsets, f"ShareGPT {Path(path).name}, burstiness {burstiness:g}")


def from_requests(requests: list[SimRequest], description: str) -> Workload:
    """Requests with their own arrival times (in order), kept in shape as a trace's are:
    `at_rate(r)` gives them at r requests per second (at `trace_rate`, their own times)."""
    offsets, rate = _at_one_per_second(np.asarray([r.arrival_s for r in requests], dtype=float))
    return Workload(list(requests), offsets, description, trace_rate=rate)
