"""The requests of `pdserve.bench.chaos`: a mix of completions whose outputs are all determined
(greedy, or sampled with a seed), their references from the offline engine, one request sent and
what came back, and the check that a completed response carries exactly the reference's tokens."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from pdserve.bench.soak import WORDS
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.detokenizer import IncrementalDetokenizer, TokenVocabulary
from pdserve.coordinator.stop_strings import StopStringMatcher
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.llm import LLM

# Stop strings that the embedded models' outputs hold often enough for some requests to end on
# one (about a third of those given them, with pdserve-tiny).
STOPS = ["or", " the", "."]
TRACE_HEADER = "x-pdserve-trace-id"  # set when tracing is on


@dataclass(slots=True)
class ChaosRequest:
    """Request `index` of the mix: its body, its prompt's token ids and, per choice, the
    sampling the server derives from the body (choice i samples with seed + i)."""

    index: int
    body: dict
    prompt_ids: list[int]
    params: list[SamplingParams]

    @property
    def stop(self) -> list[str]:
        return self.body.get("stop") or []


@dataclass(slots=True)
class Choice:
    """One choice's output as the HTTP API gives it: the text, each token's string (the
    completions API's logprobs `tokens`, one per token) and why it finished."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class Outcome:
    """What one request came to: `completed` (a 200 and every choice finished), `failed` (an
    OpenAI-style error: an HTTP status with an error body, or an error event in the stream;
    `error` says which), `unclear` (it ended otherwise: a cut connection, a body that is not
    JSON, a stream without [DONE]) or `hung` (no end within the client's own bound)."""

    index: int
    status: str
    elapsed_s: float
    error: str | None = None  # its kind: "HTTP 504 timeout", "stream internal_error", ...
    detail: str | None = None  # the error's message, or what was unclear
    choices: list[Choice] = field(default_factory=list)
    request_id: str | None = None
    trace_id: str | None = None


def request_mix(
    count: int, seed: int, model: str, max_prompt_len: int, llm: LLM
) -> list[ChaosRequest]:
    """`count` completions: text or token-id prompts of 1 to max_prompt_len words or ids, greedy
    or sampled at 0.8 with a seed, n = 2 for a tenth, stop strings for a fifth, half streamed,
    every one asking for logprobs (so each token comes back by its string)."""
    vocab = llm.tokenizer.vocab_size
    requests = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        length = rng.randrange(1, max_prompt_len + 1)
        if rng.random() < 0.5:
            prompt: str | list[int] = " ".join(rng.choice(WORDS) for _ in range(length))
            prompt_ids = llm.tokenizer.encode(prompt)
        else:
            prompt = prompt_ids = [rng.randrange(4, min(500, vocab)) for _ in range(length)]
        body: dict = {"model": model, "prompt": prompt, "max_tokens": rng.randrange(1, 49)}
        if rng.random() < 0.4:
            body["temperature"] = 0
        else:
            body["temperature"] = 0.8
            body["seed"] = i
        n = 2 if rng.random() < 0.1 else 1
        if n > 1:
            body["n"] = n
        if rng.random() < 0.2:
            body["stop"] = list(STOPS)
        body["stream"] = rng.random() < 0.5
        body["logprobs"] = 0
        params = [
            SamplingParams(
                max_tokens=body["max_tokens"],
                temperature=body["temperature"],
                seed=None if "seed" not in body else body["seed"] + c,
            )
            for c in range(n)
        ]
        requests.append(ChaosRequest(i, body, list(prompt_ids), params))
    return requests


def references(requests: list[ChaosRequest], llm: LLM, model: str) -> list[list[Choice]]:
    """Each request's choices as the offline engine makes them and the HTTP API should serve
    them: the engine's tokens, through the API's own incremental detokenizer and stop-string
    matcher fed token by token as the coordinator feeds them (so what is checked is the tokens,
    not a second detokenizer)."""
    prompts = [r.prompt_ids for r in requests for _ in r.params]
    params = [p for r in requests for p in r.params]
    outputs = iter(llm.generate(prompts, params))
    vocab = TokenVocabulary(llm.tokenizer, resolve_model_dir(model))
    expected = []
    for r in requests:
        choices = []
        for _ in r.params:
            out = next(outputs)
            detokenizer = IncrementalDetokenizer(llm.tokenizer, r.prompt_ids)
            stop = StopStringMatcher(r.stop)
            choice = Choice()
            pieces = []
            for token_id in out.token_ids:
                choice.tokens.append(vocab.token_str(token_id))
                pieces.append(stop.feed(detokenizer.step(token_id)))
                if stop.stopped:
                    break
            if not stop.stopped:
                pieces.append(stop.feed(detokenizer.flush()))
                pieces.append(stop.flush())
            choice.text = "".join(pieces)
            choice.finish_reason = "stop" if stop.stopped else out.finish_reason
            choices.append(choice)
        expected.append(choices)
    return expected


def difference(expected: list[Choice], served: list[Choice]) -> str | None:
    """How a completed response differs from the reference (None: it does not): the number of
    choices, then per choice its tokens (the first index where they part), its text and why it
    finished."""
    if len(served) != len(expected):
        return f"{len(served)} choices served, {len(expected)} expected"
    for i, (want, got) in enumerate(zip(expected, served)):
        if got.tokens != want.tokens:
            at = next(
                (k for k, (a, b) in enumerate(zip(got.tokens, want.tokens)) if a != b),
                min(len(got.tokens), len(want.tokens)),
            )
            return (
                f"choice {i}: tokens differ at index {at} ({len(got.tokens)} served, "
                f"{len(want.tokens)} expected): served {got.tokens[at : at + 3]!r}, "
                f"expected {want.tokens[at : at + 3]!r}"
            )
        if got.text != want.text:
            return f"choice {i}: text {got.text!r}, expected {want.text!r}"
        if got.finish_reason != want.finish_reason:
            return (
                f"choice {i}: finish_reason {got.finish_reason!r}, expected {want.finish_reason!r}"
            )
    return None


def error_kind(status: int | None, payload: object) -> tuple[str, str] | None:
    """(kind, message) of an OpenAI-style error body `{"error": {message, type, code}}`, or
    None when it is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
        return None
    error = payload["error"]
    message = error.get("message")
    name = error.get("code") or error.get("type")
    if not isinstance(message, str) or not isinstance(name, str):
        return None
    where = "stream" if status is None else f"HTTP {status}"
    return f"{where} {name}", message


def add_chunk(choices: dict[int, Choice], chunk: dict) -> None:
    """One chunk of a streamed completion into its choices."""
    for c in chunk.get("choices") or []:
        choice = choices.setdefault(c["index"], Choice())
        choice.text += c.get("text") or ""
        choice.tokens += (c.get("logprobs") or {}).get("tokens") or []
        if c.get("finish_reason"):
            choice.finish_reason = c["finish_reason"]


async def send(client: httpx.AsyncClient, request: ChaosRequest, bound_s: float) -> Outcome:
    """Send one request and read it to its end, for at most bound_s (then it is `hung`)."""
    outcome = Outcome(request.index, "unclear", 0.0)
    start = time.monotonic()
    try:
        async with asyncio.timeout(bound_s):
            await _exchange(client, request, outcome)
    except TimeoutError:
        outcome.status, outcome.detail = "hung", f"no end within the client's {bound_s:.0f} s"
    except httpx.HTTPError as exc:
        outcome.status, outcome.detail = "unclear", f"{type(exc).__name__}: {exc}"
    outcome.elapsed_s = round(time.monotonic() - start, 3)
    return outcome


async def _exchange(client: httpx.AsyncClient, request: ChaosRequest, outcome: Outcome) -> None:
    body = request.body
    async with client.stream("POST", "/v1/completions", json=body) as response:
        outcome.request_id = response.headers.get("x-request-id")
        outcome.trace_id = response.headers.get(TRACE_HEADER)
        if response.status_code != 200 or not body["stream"]:
            raw = await response.aread()
            try:
                payload = json.loads(raw)
            except ValueError:
                outcome.detail = f"HTTP {response.status_code}, not JSON: {raw[:200]!r}"
                return
            if response.status_code != 200:
                kind = error_kind(response.status_code, payload)
                if kind is None:
                    outcome.detail = f"HTTP {response.status_code}: {raw[:200]!r}"
                else:
                    outcome.status, (outcome.error, outcome.detail) = "failed", kind
                return
            choices: dict[int, Choice] = {}
            add_chunk(choices, payload)
            return _finish(outcome, choices)
        choices = {}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return _finish(outcome, choices)
            chunk = json.loads(line[6:])
            kind = error_kind(None, chunk)
            if kind is not None:
                outcome.status, (outcome.error, outcome.detail) = "failed", kind
                return
            add_chunk(choices, chunk)
        outcome.detail = "the stream ended without [DONE] or an error event"


def _finish(outcome: Outcome, choices: dict[int, Choice]) -> None:
    outcome.choices = [choices[i] for i in sorted(choices)]
    if all(c.finish_reason for c in outcome.choices):
        outcome.status = "completed"
    else:
        outcome.detail = "a choice without a finish_reason"


def example(request: ChaosRequest, outcome: Outcome, why: str) -> dict:
    """What the results file keeps of a request that went wrong."""
    return {
        "index": request.index,
        "why": why,
        "request_id": outcome.request_id,
        "trace_id": outcome.trace_id,
        "elapsed_s": outcome.elapsed_s,
        "body": request.body,
        "served": [asdict(c) for c in outcome.choices],
    }
