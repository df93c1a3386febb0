"""The OpenAI-compatible HTTP API (FastAPI on uvicorn, in the coordinator's event loop):
completions and chat completions, streamed as Server-Sent Events or whole, plus models, health
and Prometheus metrics. Requests are validated here so a refused one never reaches a node."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.client_messages import Event
from cluster.sampling_params import SamplingParams
from coordinator.coordinator import Coordinator, RequestHandle, SubmitError
from coordinator.detokenizer import IncrementalDetokenizer, TokenVocabulary
from coordinator.metrics import CONTENT_TYPE, Metrics
from coordinator.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    validation_error,
)  # fmt: skip
from coordinator.stop_strings import StopStringMatcher
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("pdserve.access")

RETRY_AFTER_S = 1
MAX_CHOICES = 256  # prompts x n in one request
MIN_LOGPROB = -9999.0  # JSON has no -inf


# --- request ids in the log --------------------------------------------------------------------


@dataclass(slots=True)
class RequestContext:
    request_id: str


_current: ContextVar[RequestContext | None] = ContextVar("pdserve_request", default=None)


class RequestIdLogFilter(logging.Filter):
    """Prefixes `[request id]` to any log line written while serving an HTTP request."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        if ctx is not None and ctx.request_id not in record.getMessage():
            record.msg = f"[{ctx.request_id}] {record.msg}"
        return True


class AccessLog:
    """ASGI wrapper: gives every HTTP request an id (the `x-request-id` response header) and logs
    one access line when its response has ended, streamed or not."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = RequestContext(f"http-{uuid.uuid4().hex[:16]}")
        token = _current.set(ctx)
        start = time.monotonic()
        status = 0
        body_bytes = 0

        async def send_logged(message: dict) -> None:
            nonlocal status, body_bytes
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", ctx.request_id.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                body_bytes += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        except Exception:  # already answered 500 by the app's handler; keep the server up
            logger.exception("unhandled error")
            status = status or 500
        finally:
            client = scope.get("client") or ("-", 0)
            access_logger.info(
                '%s:%s "%s %s" %d %dB %.3fs',
                client[0], client[1], scope["method"], scope["path"], status, body_bytes,
                time.monotonic() - start,
            )  # fmt: skip
            _current.reset(token)


# --- one choice: events to text ------------------------------------------------------------------


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int  # where the token's text starts in the choice's output


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def event_error(event: Event) -> APIError:
    return submit_error(SubmitError(event.error_code or "internal", event.error or "error"))


def submit_error(exc: SubmitError) -> APIError:
    if exc.code == "invalid":
        return bad_request(str(exc))
    if exc.code == "overloaded":
        return APIError(429, str(exc), "server_overloaded", code="overloaded",
                        retry_after=RETRY_AFTER_S)  # fmt: skip
    if exc.code == "unavailable":
        return APIError(503, str(exc), "service_unavailable", code="unavailable",
                        retry_after=RETRY_AFTER_S)  # fmt: skip
    return APIError(500, str(exc), "server_error", code="internal_error")


class ChoiceStream:
    """One submitted request: its events turned into text deltas that are whole characters, cut
    before the first stop string (which aborts the request so its nodes free its blocks)."""

    def __init__(
        self,
        api: OpenAIServing,
        index: int,
        prompt_token_ids: list[int],
        handle: RequestHandle,
        stop: list[str],
        logprobs: bool,
    ) -> None:
        self.api = api
        self.index = index
        self.request_id = handle.request_id
        self.handle = handle
        self.detokenizer = IncrementalDetokenizer(api.tokenizer, prompt_token_ids)
        self.stop = StopStringMatcher(stop)
        self.want_logprobs = logprobs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Until the finish; raises APIError when the request fails."""
        events = aiter(self.handle)
        while self.finish_reason is None:
            try:
                event = await anext(events)
            except StopAsyncIteration:
                raise APIError(500, "the request ended without finishing", "server_error",
                               code="internal_error") from None  # fmt: skip
            delta = self._on_event(event)
            if self.stop.stopped:
                await self.api.stop_early(self.request_id)
            yield delta

    def _on_event(self, event: Event) -> ChoiceDelta:
        if event.error is not None:
            self.finish_reason = "error"
            raise event_error(event)
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        for i, token_id in enumerate(event.token_ids):
            offset = len(self.detokenizer.text)
            self.num_output_tokens += 1
            pieces.append(self.stop.feed(self.detokenizer.step(token_id)))
            if self.want_logprobs and i < len(event.logprobs) and event.logprobs[i]:
                lp = event.logprobs[i]
                top = [(t, _logprob(v)) for t, v in lp.top]
                logprobs.append(TokenLogprob(token_id, _logprob(lp.logprob), top, offset))
            if self.stop.stopped:
                self.finish_reason = "stop"
                return ChoiceDelta(self.index, "".join(pieces), logprobs, "stop")
        reason = event.finish_reason
        if reason in ("stop", "length"):
            pieces.append(self.stop.feed(self.detokenizer.flush()))
            pieces.append(self.stop.flush())
            self.finish_reason = "stop" if self.stop.stopped else reason
        elif reason is not None:  # "abort" that this API did not ask for
            self.finish_reason = reason
            raise APIError(500, f"the request was ended by the server ({reason})", "server_error",
                           code="aborted")  # fmt: skip
        return ChoiceDelta(self.index, "".join(pieces), logprobs, self.finish_reason)


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str


# --- the API ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Submission:
    """What a validated request asks for: one prompt per choice, and their sampling params."""

    prompts: list[list[int]]  # one per distinct prompt
    params: list[SamplingParams]  # one per choice: prompt i's n choices are i*n .. i*n+n-1
    n: int
    stop: list[str]
    logprobs: bool


class OpenAIServing:
    def __init__(
        self,
        coordinator: Coordinator,
        tokenizer: Tokenizer,
        model_dir: str | Path,
        model_name: str,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.vocab = TokenVocabulary(tokenizer, model_dir)
        self.model_name = model_name
        self.model_names = {model_name, *aliases}
        self.created = int(time.time())
        self.metrics = Metrics(coordinator)
        coordinator.listeners.append(self.metrics.observe)

    # --- parsing and validation ---------------------------------------------------------------

    async def parse(
        self, request: Request, model: type
    ) -> CompletionRequest | ChatCompletionRequest:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"The body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise bad_request("The body must be a JSON object", code="invalid_type")
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        body.check()
        if body.model is not None and body.model not in self.model_names:
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model",
                           code="model_not_found")  # fmt: skip
        return body

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request(f"'{param}' must not be empty", param)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in '{param}' is outside the vocabulary [0, {vocab})",
                              param)  # fmt: skip
        return ids

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str):
            prompts = [self.tokenizer.encode(p)]
        elif not p:
            raise bad_request("'prompt' must not be empty", "prompt")
        elif isinstance(p[0], str):
            prompts = [self.tokenizer.encode(s) for s in p]
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [list(ids) for ids in p]
        return [self.check_token_ids(ids, "prompt") for ids in prompts]

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in body.messages]
        try:
            ids = self.tokenizer.encode_chat(messages, body.add_generation_prompt)
        except (jinja2.TemplateError, ValueError) as exc:
            raise bad_request(f"the chat template failed: {exc}", "messages") from None
        return self.check_token_ids(ids, "messages")

    def max_tokens(
        self, requested: int | None, prompt_len: int, default: int | None, param: str
    ) -> int:
        """The completion's length: refused (400) when prompt + completion exceed the context."""
        limit = self.coordinator.max_model_len
        if limit <= 0:
            raise submit_error(SubmitError("unavailable", "no node is available"))
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {prompt_len} tokens, leaving no room for a completion.",
                param, "context_length_exceeded",
            )  # fmt: skip
        room = limit - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                "completion). Please reduce the prompt or the completion length.",
                "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        return requested

    def submission(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        requested_max: int | None,
        default_max: int | None,
        num_logprobs: int | None,
        prompt_param: str,
    ) -> Submission:
        n = body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        params: list[SamplingParams] = []
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
                )
                try:
                    params.append(SamplingParams.from_dict(
                        {k: v for k, v in fields.items() if v is not None or k == "seed"}
                    ))  # fmt: skip
                except ValueError as exc:
                    raise bad_request(str(exc), str(exc).split()[0]) from None
        return Submission(prompts, params, n, body.stop_strings, num_logprobs is not None)

    # --- running requests ----------------------------------------------------------------------

    async def submit(self, request_id: str, sub: Submission) -> list[ChoiceStream]:
        """Submit every choice, or none: a refusal aborts those already in."""
        limit = self.coordinator.config.max_pending_requests
        if self.coordinator.num_pending + len(sub.params) > limit:
            # Refused whole, before any choice reaches a node.
            logger.info("refused: %d requests already pending", self.coordinator.num_pending)
            raise submit_error(SubmitError("overloaded", "the server is overloaded; retry later"))
        choices: list[ChoiceStream] = []
        try:
            for index, params in enumerate(sub.params):
                prompt = sub.prompts[index // sub.n]
                handle = await self.coordinator.submit(prompt, params, f"{request_id}-{index}")
                choices.append(ChoiceStream(self, index, prompt, handle, sub.stop, sub.logprobs))
        except SubmitError as exc:
            logger.info("refused (%s): %s", exc.code, exc)
            await self.abort(choices)
            raise submit_error(exc) from None
        logger.info("submitted %d choice(s), prompt tokens %s, max_tokens %d", len(choices),
                    [len(p) for p in sub.prompts], sub.params[0].max_tokens)  # fmt: skip
        return choices

    async def abort(self, choices: list[ChoiceStream]) -> None:
        """Free every unfinished choice on every node. Coordinator.abort does not suspend, so this
        completes even inside a cancelled task (a client that went away)."""
        for choice in choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                await self.coordinator.abort(choice.request_id)

    async def stop_early(self, request_id: str) -> None:
        """A stop string matched: the request is done for the client; free it everywhere."""
        if await self.coordinator.abort(request_id, reason="stop"):
            logger.info("[%s] stop string matched: request released", request_id)

    async def collect(self, request: Request, choices: list[ChoiceStream]) -> list[ChoiceResult]:
        """Whole outputs; a client that disconnects first gets its requests aborted."""

        async def one(choice: ChoiceStream) -> ChoiceResult:
            text: list[str] = []
            logprobs: list[TokenLogprob] = []
            async for delta in choice.deltas():
                text.append(delta.text)
                logprobs += delta.logprobs
            return ChoiceResult(choice.index, "".join(text), logprobs, choice.finish_reason or "")

        tasks = [asyncio.create_task(one(c)) for c in choices]
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

    async def stream(
        self,
        choices: list[ChoiceStream],
        n: int,
        base: dict,
        render: Callable[[ChoiceDelta], dict],
        head: list[dict],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-Sent Events: the head chunks, each choice's deltas as they come, the usage chunk
        if asked, `[DONE]`. An error ends the stream with an error chunk; leaving it early (the
        client went away) aborts every unfinished choice."""
        queue: asyncio.Queue = asyncio.Queue()
        usage_null = {"usage": None} if include_usage else {}

        async def pump(choice: ChoiceStream) -> None:
            try:
                async for delta in choice.deltas():
                    queue.put_nowait(delta)
            except APIError as exc:
                queue.put_nowait(exc)
            except Exception:
                logger.exception("[%s] failed", choice.request_id)
                queue.put_nowait(
                    APIError(500, "internal error", "server_error", code="internal_error")
                )
            finally:
                queue.put_nowait(choice)  # its end

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            for chunk in head:
                yield sse({**chunk, **usage_null})
            remaining = len(choices)
            while remaining:
                item = await queue.get()
                if isinstance(item, ChoiceStream):
                    remaining -= 1
                elif isinstance(item, APIError):
                    logger.warning("stream failed: %s", item.message)
                    yield sse(item.body())
                    break
                elif item.text or item.logprobs or item.finish_reason:
                    yield sse({**render(item), **usage_null})
            else:
                if include_usage:
                    yield sse({**base, "choices": [], "usage": self.usage(choices, n)})
            yield "data: [DONE]\n\n"
        finally:
            if any(c.finish_reason is None for c in choices):
                logger.info("stream left early: aborting its unfinished choices")
            for task in tasks:
                task.cancel()
            await self.abort(choices)

    # --- responses -----------------------------------------------------------------------------

    def usage(self, choices: list[ChoiceStream], n: int) -> dict:
        firsts = [c for c in choices if c.index % n == 0]  # the prompt counts once, not n times
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(c.num_output_tokens for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)},
        }

    def completion_logprobs(self, entries: list[TokenLogprob]) -> dict:
        """The legacy completions format."""
        top_logprobs = []
        for e in entries:
            top = {self.vocab.token_str(t): lp for t, lp in e.top}
            top.setdefault(self.vocab.token_str(e.token_id), e.logprob)
            top_logprobs.append(top)
        return {
            "tokens": [self.vocab.token_str(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top_logprobs,
            "text_offset": [e.text_offset for e in entries],
        }

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            return {
                "token": self.vocab.token_str(token_id),
                "logprob": logprob,
                "bytes": list(self.vocab.token_bytes(token_id)),
            }

        content = [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content, "refusal": None}

    async def completions(self, request: Request) -> Response:
        body = await self.parse(request, CompletionRequest)
        request_id = name_request("cmpl")
        prompts = self.completion_prompts(body)
        sub = self.submission(body, prompts, body.max_tokens, 16, body.logprobs, "prompt")
        choices = await self.submit(request_id, sub)
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}  # fmt: skip
        with_logprobs = body.logprobs is not None

        def choice(index: int, text: str, logprobs: list, finish_reason: str | None) -> dict:
            return {
                "index": index,
                "text": text,
                "logprobs": self.completion_logprobs(logprobs) if with_logprobs else None,
                "finish_reason": finish_reason,
            }

        if body.stream:

            def render(d: ChoiceDelta) -> dict:
                return {**base, "choices": [choice(d.index, d.text, d.logprobs, d.finish_reason)]}

            chunks = self.stream(choices, sub.n, base, render, [], body.include_usage)
            return EventStream(chunks, on_close=lambda: self.abort(choices))
        results = await self.collect(request, choices)
        return JSONResponse({
            **base,
            "choices": [choice(r.index, r.text, r.logprobs, r.finish_reason) for r in results],
            "usage": self.usage(choices, sub.n),
        })  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        body = await self.parse(request, ChatCompletionRequest)
        request_id = name_request("chatcmpl")
        prompt = self.chat_prompt(body)
        requested = body.max_completion_tokens or body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sub = self.submission(body, [prompt], requested, None, num_logprobs, "messages")
        choices = await self.submit(request_id, sub)
        base = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name}  # fmt: skip

        def logprobs(entries: list[TokenLogprob]) -> dict | None:
            return self.chat_logprobs(entries) if body.logprobs else None

        if body.stream:
            chunk = {**base, "object": "chat.completion.chunk"}
            head = [
                {**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]}
                for c in choices
            ]  # fmt: skip

            def render(d: ChoiceDelta) -> dict:
                delta = {"content": d.text} if d.text else {}
                return {**chunk, "choices": [{"index": d.index, "delta": delta,
                        "logprobs": logprobs(d.logprobs), "finish_reason": d.finish_reason}]}  # fmt: skip

            chunks = self.stream(choices, sub.n, chunk, render, head, body.include_usage)
            return EventStream(chunks, on_close=lambda: self.abort(choices))
        results = await self.collect(request, choices)
        return JSONResponse({
            **base,
            "choices": [
                {"index": r.index, "message": {"role": "assistant", "content": r.text},
                 "logprobs": logprobs(r.logprobs), "finish_reason": r.finish_reason}
                for r in results
            ],
            "usage": self.usage(choices, sub.n),
        })  # fmt: skip

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{
                "id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pdserve", "max_model_len": self.coordinator.max_model_len,
            }],
        }  # fmt: skip


def name_request(prefix: str) -> str:
    """A fresh completion id, which every log line of this HTTP request carries from here on."""
    request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
    ctx = _current.get()
    if ctx is not None:
        ctx.request_id = request_id
    return request_id


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


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def build_app(serving: OpenAIServing) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            logger.warning("%d: %s", exc.status, exc.message)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, "internal server error", "server_error",
                                       code="internal_error"))  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models()

    @app.get("/health")
    async def health() -> Response:
        if serving.coordinator.ready():
            return JSONResponse({"status": "ok"})
        return error_response(APIError(503, "no node of a needed kind is ready",
                                       "service_unavailable", code="unavailable",
                                       retry_after=RETRY_AFTER_S))  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    return app


# --- serving ---------------------------------------------------------------------------------


def served_model_name(model: str | None) -> str:
    """What clients call the model: `pdserve-tiny`, or the checkpoint directory's name."""
    return "pdserve-tiny" if model in (None, "pdserve-tiny") else Path(model).resolve().name


def listen_socket(host: str, port: int) -> socket.socket:
    """Bound before uvicorn starts, so a busy port is a clean error, and port 0 works."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class _Server(uvicorn.Server):
    # The coordinator's process owns the signals (stop, SIGHUP reload); uvicorn must not.
    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201
        yield


async def serve_http(app: FastAPI, sock: socket.socket, stop: asyncio.Event) -> None:
    """Run uvicorn in this event loop on `sock` until `stop` is set."""
    root = logging.getLogger()
    log_filter = RequestIdLogFilter()
    for handler in root.handlers:
        handler.addFilter(log_filter)
    config = uvicorn.Config(
        AccessLog(app),
        log_config=None,  # our logging setup, not uvicorn's
        log_level=root.level,
        access_log=False,  # AccessLog writes one line per request, after streaming
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="http")
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if serving.done():
            serving.result()
            return
        host, port = sock.getsockname()[:2]
        print(f"pdserve: serving http://{host}:{port}", flush=True)
        waiting = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        for handler in root.handlers:
            handler.removeFilter(log_filter)
        sock.close()
