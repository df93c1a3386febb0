"""What completions and chat completions share: parsing and validating a body, turning it into
one submission per choice, running those on the coordinator (whole or as Server-Sent Events,
aborted however the client leaves) and counting usage."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.choice_stream import ChoiceDelta, ChoiceResult, ChoiceStream
from pdserve.coordinator.coordinator import Coordinator, SubmitError
from pdserve.coordinator.detokenizer import TokenVocabulary
from pdserve.coordinator.metrics import Metrics
from pdserve.coordinator.openai_protocol import (
    APIError,
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    coordinator_error,
    parse_body,
)
from pdserve.coordinator.reasoning_parsers import PARSERS as REASONING_PARSERS
from pdserve.coordinator.reasoning_parsers import ReasoningPlan
from pdserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_CHOICES = 256  # prompts x n in one request


@dataclass(slots=True)
class Submission:
    """What a validated request asks for: one prompt per choice, and their sampling params."""

    prompts: list[list[int]]  # one per distinct prompt
    params: list[SamplingParams]  # one per choice: prompt i's n choices are i*n .. i*n+n-1
    n: int
    stop: list[str]
    logprobs: bool
    # The field a constraint came from: a constrained request is answered once its nodes have
    # compiled the constraint, so what they cannot compile is a 400 naming that field.
    constraint_param: str | None = None
    # The output's text keeps the model's special tokens (a reasoning format made of them).
    keep_special_tokens: bool = False


class OpenAIServing:
    """The served model and the coordinator behind it, shared by the completions, chat and
    tokenization endpoints; also the server's metrics, fed by the coordinator's request events."""

    def __init__(
        self,
        coordinator: Coordinator,
        tokenizer: Tokenizer,
        model_dir: str | Path,
        model_name: str,
        aliases: tuple[str, ...] = (),
        listed: tuple[str, ...] = (),
    ) -> None:
        """model_name: the name responses carry when a request names none; aliases: other names
        requests may use; listed: the names /v1/models lists (default: model_name)."""
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.model_dir = str(model_dir)
        self.vocab = TokenVocabulary(tokenizer, model_dir)
        self.model_name = model_name
        self.model_names = {model_name, *aliases}
        self.listed = listed or (model_name,)
        self.created = int(time.time())
        self._markers: dict[str, list[int]] = {}
        self.metrics = Metrics(coordinator, model_name)
        coordinator.listeners.append(self.metrics.observe)

    def models(self) -> dict:
        max_model_len = self.coordinator.max_model_len
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "pdserve",
                    "root": self.model_dir,
                    "parent": None,
                    "max_model_len": max_model_len,
                }
                for name in self.listed
            ],
        }

    def reasoning_plan(self, prompt_text: str) -> ReasoningPlan | None:
        """How a chat request whose prompt renders as prompt_text reasons, with the server's
        reasoning parser (None without one)."""
        name = self.coordinator.config.reasoning_parser
        return None if name is None else REASONING_PARSERS[name]().plan(prompt_text)

    def marker_ids(self, marker: str) -> list[int]:
        """A reasoning marker's token ids (one id for models that made it a token of its own)."""
        ids = self._markers.get(marker)
        if ids is None:
            ids = self._markers[marker] = self.tokenizer.encode(marker, add_special_tokens=False)
        return ids

    def response_model(self, requested: str | None) -> str:
        """The `model` a response carries: the name the request used, or the first name."""
        return requested if requested in self.model_names else self.model_name

    # --- parsing and validation ---------------------------------------------------------------

    async def parse(self, request: Request, model: type[Body]) -> Body:
        return self.check_model(parse_body(await request.body(), model, self.coordinator.config))

    def check_model(self, body: Body) -> Body:
        name = getattr(body, "model", None)
        if name is not None and name not in self.model_names:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return body

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request(f"'{param}' must not be empty", param)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} in '{param}' is outside the vocabulary [0, {vocab})", param
            )
        return ids

    def max_tokens(
        self, requested: int | None, prompt_len: int, default: int | None, param: str
    ) -> int:
        """The completion's length: refused (400) when prompt + completion exceed the context."""
        limit = self.coordinator.max_model_len
        if limit <= 0:
            raise coordinator_error("unavailable", "no node is available")
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {prompt_len} tokens, leaving no room for a completion.",
                param,
                "context_length_exceeded",
            )
        room = limit - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                "completion). Please reduce the prompt or the completion length.",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    def submission(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        requested_max: int | None,
        default_max: int | None,
        num_logprobs: int | None,
        prompt_param: str,
        reasoning: ReasoningPlan | None = None,
    ) -> Submission:
        """reasoning: the chat request's reasoning, past which its constraint begins."""
        n = body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        params: list[SamplingParams] = []
        structured, constraint_param = body.constraint()
        if structured is not None and reasoning is not None and reasoning.may_reason:
            after = self.marker_ids(reasoning.parser.end)
            structured = msgspec.structs.replace(structured, after=after)
        for ids in prompts:
            max_tokens = self.max_tokens(requested_max, len(ids), default_max, prompt_param)
            for i in range(n):
                fields = dict(
                    max_tokens=max_tokens,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=body.top_k,
                    min_p=body.min_p,
                    seed=None if body.seed is None else body.seed + i,
                    stop_token_ids=body.stop_token_ids,
                    ignore_eos=body.ignore_eos,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    logprobs=num_logprobs,
                    structured=structured,
                )
                try:
                    params.append(
                        SamplingParams.from_dict(
                            {k: v for k, v in fields.items() if v is not None or k == "seed"}
                        )
                    )
                except ValueError as exc:
                    raise bad_request(str(exc), str(exc).split()[0]) from None
        keep_special = reasoning is not None and reasoning.parser.keeps_special_tokens
        return Submission(
            prompts,
            params,
            n,
            body.stop_strings,
            num_logprobs is not None,
            constraint_param,
            keep_special,
        )

    # --- running requests ----------------------------------------------------------------------

    async def submit(self, request_id: str, sub: Submission) -> list[ChoiceStream]:
        """Submit every choice, or none: a refusal aborts those already in."""
        choices: list[ChoiceStream] = []
        try:
            # Refused whole, before any choice reaches a node.
            tokens = sum(len(sub.prompts[i // sub.n]) for i in range(len(sub.params)))
            self.coordinator.check_room(len(sub.params), tokens)
            for index, params in enumerate(sub.params):
                prompt = sub.prompts[index // sub.n]
                handle = await self.coordinator.submit(prompt, params, f"{request_id}-{index}")
                choices.append(
                    ChoiceStream(
                        self.coordinator,
                        self.tokenizer,
                        index,
                        prompt,
                        handle,
                        sub.stop,
                        sub.logprobs,
                        sub.constraint_param,
                        sub.keep_special_tokens,
                    )
                )
        except SubmitError as exc:
            logger.info("refused (%s): %s", exc.code, exc)
            await self.abort(choices)
            raise coordinator_error(exc.code, str(exc)) from None
        if sub.constraint_param is not None:
            try:  # answered (even streamed) once every node took the constraint
                await asyncio.gather(*(c.started() for c in choices))
            except APIError:
                await self.abort(choices)
                raise
        logger.info(
            "submitted %d choice(s), prompt tokens %s, max_tokens %d",
            len(choices),
            [len(p) for p in sub.prompts],
            sub.params[0].max_tokens,
        )
        return choices

    async def abort(self, choices: list[ChoiceStream]) -> None:
        """Free every unfinished choice on every node."""
        for choice in choices:
            await choice.abort()

    async def collect(self, request: Request, choices: list[ChoiceStream]) -> list[ChoiceResult]:
        """Whole outputs; a client that disconnects first gets its requests aborted."""
        tasks = [asyncio.create_task(c.result()) for c in choices]
        gone = asyncio.create_task(wait_for_disconnect(request))
        try:
            pending: set[asyncio.Task] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(
                    pending | {gone}, return_when=asyncio.FIRST_COMPLETED
                )
                if gone in done:
                    logger.info("client disconnected; aborting")
                    raise APIError(499, "client disconnected", code="client_disconnected")
                pending.discard(gone)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
            return [task.result() for task in tasks]
        finally:
            gone.cancel()
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a second failure is not logged as lost
                task.cancel()
            await self.abort(choices)

    def stream(
        self,
        choices: list[ChoiceStream],
        n: int,
        base: dict,
        render: Callable[[ChoiceDelta], dict],
        head: list[dict],
        include_usage: bool,
        reasoning: ReasoningPlan | None = None,
    ) -> EventStream:
        """The choices' deltas as Server-Sent Events, each rendered as a chunk by `render`."""
        chunks = self._events(choices, n, base, render, head, include_usage, reasoning)
        return EventStream(chunks, on_close=lambda: self.abort(choices))

    async def _events(
        self,
        choices: list[ChoiceStream],
        n: int,
        base: dict,
        render: Callable[[ChoiceDelta], dict],
        head: list[dict],
        include_usage: bool,
        reasoning: ReasoningPlan | None,
    ) -> AsyncIterator[str]:
        """The head chunks, each choice's deltas as they come, the usage chunk if asked,
        `[DONE]`. An error ends the stream with an error chunk; leaving it early (the client went
        away) aborts every unfinished choice."""
        usage_null = {"usage": None} if include_usage else {}
        try:
            for chunk in head:
                yield sse({**chunk, **usage_null})
            async with contextlib.aclosing(_interleaved(choices)) as items:
                async for item in items:
                    if isinstance(item, APIError):
                        if item.code != "server_shutdown":  # the coordinator logged the cut
                            logger.warning("stream failed: %s", item.message)
                        yield sse(item.body())
                        break
                    if item.text or item.logprobs or item.finish_reason:
                        yield sse({**render(item), **usage_null})
                else:
                    if include_usage:
                        yield sse(
                            {**base, "choices": [], "usage": self.usage(choices, n, reasoning)}
                        )
            yield "data: [DONE]\n\n"
        finally:
            if any(c.finish_reason is None for c in choices):
                logger.info("stream left early: aborting its unfinished choices")
            await self.abort(choices)

    def usage(
        self, choices: list[ChoiceStream], n: int, reasoning: ReasoningPlan | None = None
    ) -> dict:
        """The request's token counts; with reasoning, how many of the completion's reasoned."""
        firsts = [c for c in choices if c.index % n == 0]  # the prompt counts once, not n times
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(c.num_output_tokens for c in choices)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)},
        }
        if reasoning is not None:
            start, end = (
                self.marker_ids(reasoning.parser.start),
                self.marker_ids(reasoning.parser.end),
            )
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(
                    reasoning.reasoning_tokens(c.output_token_ids, start, end) for c in choices
                )
            }
        return usage


async def _interleaved(choices: list[ChoiceStream]) -> AsyncIterator[ChoiceDelta | APIError]:
    """Every choice's deltas as they come, until each has ended; a choice that fails yields its
    APIError (a 500 for an unexpected error), after which the caller stops reading."""
    if len(choices) == 1:
        # One choice (most requests): read in the response's own task, with no task and queue
        # between them, which cost a task switch and two queue operations per token.
        try:
            async with contextlib.aclosing(choices[0].deltas()) as deltas:
                async for delta in deltas:
                    yield delta
        except APIError as exc:
            yield exc
        except Exception:
            logger.exception("[%s] failed", choices[0].request_id)
            yield APIError(500, "internal error", "server_error", code="internal_error")
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: ChoiceStream) -> None:
        try:
            async for delta in choice.deltas():
                queue.put_nowait(delta)
        except APIError as exc:
            queue.put_nowait(exc)
        except Exception:
            logger.exception("[%s] failed", choice.request_id)
            queue.put_nowait(APIError(500, "internal error", "server_error", code="internal_error"))
        finally:
            queue.put_nowait(None)  # its end

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-Sent Events whose requests are aborted however the response ends, even when it is
    cancelled before its generator ever ran (a client gone before the first byte)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
