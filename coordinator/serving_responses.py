"""`POST /v1/responses` (OpenAI's Responses API) through the chat path: the body becomes the
internal chat request, runs as one choice, and its output (reasoning, content, tool calls) comes
back as a `response` object of output items, whole or as the typed Server-Sent Events; stored
responses (`GET`/`DELETE /v1/responses/{id}`, `previous_response_id`) in a bounded store."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.coordinator.access_log import name_request
from pdserve.coordinator.chat_output import ChatOutput, ChatOutputStream, chat_output
from pdserve.coordinator.choice_stream import ChoiceStream
from pdserve.coordinator.openai_protocol import APIError
from pdserve.coordinator.reasoning_parsers import ReasoningPlan
from pdserve.coordinator.response_store import ResponseStore
from pdserve.coordinator.responses_protocol import (
    ResponsesRequest,
    echo,
    output_messages,
    parse_responses_body,
    responses_fields,
)
from pdserve.coordinator.serving import EventStream, OpenAIServing, _interleaved
from pdserve.coordinator.serving_chat import OpenAIServingChat
from pdserve.coordinator.tool_choice import ToolPlan, new_call_id

logger = logging.getLogger(__name__)


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"No response with id '{response_id}' is stored.", param=param, code="not_found"
    )


def usage(chat: dict) -> dict:
    """The chat usage in the Responses names."""
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": chat.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
        },
        "total_tokens": chat["total_tokens"],
    }


def finished(response: dict, finish_reason: str, chat_usage: dict) -> dict:
    """The response object once its output is whole: completed, or incomplete when cut."""
    cut = finish_reason == "length"
    return {
        **response,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "completed_at": None if cut else int(time.time()),
        "usage": usage(chat_usage),
    }


def reasoning_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {
        "type": "reasoning",
        "id": item_id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def message_item(text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(output: ChatOutput) -> list[dict]:
    """A whole output's items: its reasoning, its message, its calls."""
    status = "incomplete" if output.finish_reason == "length" else "completed"
    items = []
    if output.reasoning is not None:
        items.append(reasoning_item(output.reasoning))
    if output.content or not output.calls:
        items.append({**message_item(output.content or ""), "status": status})
    for call in output.calls:
        items.append(call_item(new_call_id(), call.name, call.arguments))
    return items


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing, chat: OpenAIServingChat) -> None:
        self.serving = serving
        self.chat = chat
        config = serving.coordinator.config
        self.store = ResponseStore(
            lambda: (config.max_stored_responses, config.stored_response_ttl_s)
        )

    def get(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def create_response(self, request: Request) -> Response:
        serving = self.serving
        config = serving.coordinator.config
        body = serving.check_model(parse_responses_body(await request.body(), config))
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = previous.messages
        chat = body.chat_request(history, config)
        request_id = name_request("resp")
        response_id = request_id.replace("-", "_", 1)
        with responses_fields():
            prompt, prompt_text = self.chat.prompt(chat)
            reasoning = serving.reasoning_plan(prompt_text)
            sub = serving.submission(
                chat, [prompt], chat.max_tokens, None, None, "messages", reasoning
            )
            choices = await serving.submit(request_id, sub)
        response = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": serving.response_model(body.model),
            "output": [],
            "usage": None,
            **echo(body),
        }
        conversation = history + body.input_messages()
        if body.stream:
            events = self._events(body, chat.tool_plan, reasoning, choices, response, conversation)
            return EventStream(events, on_close=lambda: serving.abort(choices))
        (result,) = await serving.collect(request, choices)
        output = chat_output(result.text, result.finish_reason, chat.tool_plan, reasoning)
        response["output"] = output_items(output)
        response = finished(response, result.finish_reason, serving.usage(choices, 1, reasoning))
        self._keep(body, response, conversation)
        return JSONResponse(response)

    def _keep(self, body: ResponsesRequest, response: dict, conversation: list[dict]) -> None:
        if body.store is not False:
            messages = conversation + output_messages(response["output"])
            self.store.put(response["id"], response, messages)

    async def _events(
        self,
        body: ResponsesRequest,
        tools: ToolPlan,
        reasoning: ReasoningPlan | None,
        choices: list[ChoiceStream],
        response: dict,
        conversation: list[dict],
    ) -> AsyncIterator[str]:
        """created, in_progress, each output item's events as its text comes, then completed (or
        incomplete); an error ends the stream with an `error` event."""
        stream = ResponseEventStream(ChatOutputStream(tools, reasoning))
        try:
            yield stream.event("response.created", response=response)
            yield stream.event("response.in_progress", response=response)
            finish_reason = None
            async with contextlib.aclosing(_interleaved(choices)) as deltas:
                async for delta in deltas:
                    if isinstance(delta, APIError):
                        if delta.code != "server_shutdown":  # the coordinator logged the cut
                            logger.warning("stream failed: %s", delta.message)
                        yield stream.event(
                            "error", code=delta.code, message=delta.message, param=delta.param
                        )
                        return
                    for event in stream.feed(delta.text, delta.finish_reason):
                        yield event
                    finish_reason = delta.finish_reason or finish_reason
            if finish_reason is None:  # ended without an end: nothing to complete
                return
            whole = {**response, "output": stream.items}
            whole = finished(whole, finish_reason, self.serving.usage(choices, 1, reasoning))
            self._keep(body, whole, conversation)
            kind = "response.completed" if whole["status"] == "completed" else "response.incomplete"
            yield stream.event(kind, response=whole)
        finally:
            if any(c.finish_reason is None for c in choices):
                logger.info("stream left early: aborting its unfinished choices")
            await self.serving.abort(choices)


class ResponseEventStream:
    """One streamed output's Responses events: the output items opened, fed and closed in turn
    (at most one open at a time), each event numbered."""

    def __init__(self, output: ChatOutputStream) -> None:
        self.output = output
        self.sequence = 0
        self.items: list[dict] = []  # the output so far, in order
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # the chat delta's call index -> its item

    def event(self, kind: str, **fields: object) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {text}\n\n"

    def feed(self, text: str, finish_reason: str | None) -> list[str]:
        piece = self.output.feed(text, finish_reason is not None)
        events: list[str] = []
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("message", piece.content)
        for call in piece.tool_calls:
            events += self._call(call)
        if finish_reason is not None:
            if not any(item["type"] != "reasoning" for item in self.items):
                events += self._text("message", "")  # an empty answer is an empty message
            events += self._close("incomplete" if finish_reason == "length" else "completed")
        return events

    def _add(self, item: dict) -> list[str]:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=index, item=dict(item))]

    def _text(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        part_kind = "reasoning_text" if kind == "reasoning" else "output_text"
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            new = reasoning_item("", "in_progress") if kind == "reasoning" else None
            events += self._add(new or message_item("", "in_progress"))
            part = {"type": part_kind, "text": ""}
            if kind == "message":
                part.update(annotations=[], logprobs=[])
            self.open["content"] = [part]
            events.append(self.event("response.content_part.added", **self._at(), part=part))
        if not text:
            return events
        self.open["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(f"response.{part_kind}.delta", **self._at(), delta=text, **extra))
        return events

    def _call(self, delta: dict) -> list[str]:
        events: list[str] = []
        function = delta.get("function", {})
        args = function.get("arguments") or ""
        if "id" in delta:  # a new call
            events += self._close("completed")
            events += self._add(call_item(delta["id"], function["name"], "", "in_progress"))
            self.calls[delta["index"]] = self.open
        item = self.calls.get(delta["index"])
        if item is None or not args:
            return events
        item["arguments"] += args
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        events.append(self.event("response.function_call_arguments.delta", **at, delta=args))
        return events

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _close(self, status: str) -> list[str]:
        """The open item's done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events: list[str] = []
        if item["type"] == "function_call":
            at = {"item_id": item["id"], "output_index": index}
            events.append(self.event("response.function_call_arguments.done", **at, **_args(item)))
        else:
            part = item["content"][0]
            kind = part["type"]
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            extra = {"logprobs": []} if kind == "output_text" else {}
            events.append(self.event(f"response.{kind}.done", **at, text=part["text"], **extra))
            events.append(self.event("response.content_part.done", **at, part=part))
        item["status"] = status if item["type"] == "message" else "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def _args(item: dict) -> dict:
    return {"arguments": item["arguments"], "name": item["name"]}
