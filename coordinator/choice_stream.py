"""One choice of an HTTP request: its coordinator events turned into text deltas of whole
characters with their logprobs, cut at the first stop string, and ended on the nodes early."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.cluster.client_messages import Event
from pdserve.coordinator.coordinator import Coordinator, RequestHandle
from pdserve.coordinator.detokenizer import IncrementalDetokenizer
from pdserve.coordinator.openai_protocol import APIError, coordinator_error
from pdserve.coordinator.stop_strings import StopStringMatcher
from pdserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # JSON has no -inf


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


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class ChoiceStream:
    """One submitted request: its events turned into text deltas that are whole characters, cut
    before the first stop string (which aborts the request so its nodes free its blocks)."""

    def __init__(
        self,
        coordinator: Coordinator,
        tokenizer: Tokenizer,
        index: int,
        prompt_token_ids: list[int],
        handle: RequestHandle,
        stop: list[str],
        logprobs: bool,
        constraint_param: str | None = None,
        keep_special_tokens: bool = False,
    ) -> None:
        """constraint_param: the request field of its constraint, which an error names;
        keep_special_tokens: the text shows them (a reasoning format's markers)."""
        self.coordinator = coordinator
        self.constraint_param = constraint_param
        self._events = aiter(handle)
        self._first: Event | None = None  # read by `started`, not yet turned into a delta
        self.index = index
        self.request_id = handle.request_id
        self.handle = handle
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=not keep_special_tokens
        )
        self.stop = StopStringMatcher(stop)
        self.want_logprobs = logprobs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Until the finish; raises APIError when the request fails."""
        while self.finish_reason is None:
            try:
                event = await self._next_event()
            except StopAsyncIteration:
                raise APIError(
                    500,
                    "the request ended without finishing",
                    "server_error",
                    code="internal_error",
                ) from None
            delta = self._on_event(event)
            if self.stop.stopped:
                await self._stop_early()
            yield delta

    async def _next_event(self) -> Event:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        return await anext(self._events)

    async def started(self) -> None:
        """Until its first event (a node took the request): raises APIError if that is an error
        (a constraint no node could compile)."""
        event = await anext(self._events)
        if event.error is not None:
            self.finish_reason = "error"
            raise self._error(event)
        self._first = event

    def _error(self, event: Event) -> APIError:
        error = coordinator_error(event.error_code or "internal", event.error or "error")
        if event.error_code == "invalid" and self.constraint_param is not None:
            error.param = self.constraint_param
        return error

    async def result(self) -> ChoiceResult:
        """The whole output; raises APIError when the request fails."""
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        async for delta in self.deltas():
            text.append(delta.text)
            logprobs += delta.logprobs
        return ChoiceResult(self.index, "".join(text), logprobs, self.finish_reason or "")

    async def abort(self) -> None:
        """Free it on every node unless it has finished. Coordinator.abort does not suspend, so
        this completes even inside a cancelled task (a client that went away)."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            await self.coordinator.abort(self.request_id)

    async def _stop_early(self) -> None:
        """A stop string matched: the request is done for the client; free it everywhere."""
        if await self.coordinator.abort(self.request_id, reason="stop"):
            logger.info("[%s] stop string matched: request released", self.request_id)

    def _on_event(self, event: Event) -> ChoiceDelta:
        if event.error is not None:
            self.finish_reason = "error"
            raise self._error(event)
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        for i, token_id in enumerate(event.token_ids):
            offset = len(self.detokenizer.text)
            self.num_output_tokens += 1
            self.output_token_ids.append(token_id)
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
            raise APIError(
                500,
                f"the request was ended by the server ({reason})",
                "server_error",
                code="aborted",
            )
        return ChoiceDelta(self.index, "".join(pieces), logprobs, self.finish_reason)
