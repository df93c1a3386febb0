"""`POST /v1/messages` and `POST /v1/messages/count_tokens`, Anthropic's Messages API: its body
becomes the internal chat request and runs as chat completions do (the same prompt, checks,
submission, reasoning and tool-call parsing); its output is rendered as Anthropic's content
blocks, whole or as the stream's events."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.coordinator.access_log import name_request
from pdserve.coordinator.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    parse_messages_body,
)
from pdserve.coordinator.chat_output import ChatOutput, ChatOutputStream, OutputDelta, chat_output
from pdserve.coordinator.choice_stream import ChoiceStream
from pdserve.coordinator.openai_protocol import APIError, ChatCompletionRequest
from pdserve.coordinator.reasoning_parsers import ReasoningPlan
from pdserve.coordinator.serving import EventStream, OpenAIServing, _interleaved
from pdserve.coordinator.serving_chat import OpenAIServingChat
from pdserve.coordinator.tool_choice import ToolPlan, new_call_id

logger = logging.getLogger(__name__)


class AnthropicServingMessages:
    def __init__(self, serving: OpenAIServing, chat: OpenAIServingChat) -> None:
        self.serving = serving
        self.chat = chat

    async def parse(
        self, request: Request, model: type[CountTokensRequest]
    ) -> tuple[CountTokensRequest, ChatCompletionRequest]:
        raw = await request.body()
        body, chat_body = parse_messages_body(raw, model, self.serving.coordinator.config)
        self.serving.check_model(chat_body)
        return body, chat_body

    async def count_tokens(self, request: Request) -> dict:
        """The prompt's length, rendered as /v1/messages renders it."""
        _, chat_body = await self.parse(request, CountTokensRequest)
        prompt, _ = self.chat.prompt(chat_body)
        return {"input_tokens": len(prompt)}

    async def create_message(self, request: Request) -> Response:
        serving = self.serving
        body, chat_body = await self.parse(request, MessagesRequest)
        assert isinstance(body, MessagesRequest)
        request_id = name_request("msg")
        prompt, prompt_text = self.chat.prompt(chat_body)
        reasoning = serving.reasoning_plan(prompt_text)
        sub = serving.submission(
            chat_body, [prompt], body.max_tokens, None, None, "messages", reasoning
        )
        choices = await serving.submit(request_id, sub)
        message = {
            "id": "msg_" + request_id.partition("-")[2],
            "type": "message",
            "role": "assistant",
            "model": serving.response_model(body.model),
        }
        if body.stream:
            events = self._events(choices, message, chat_body.tool_plan, reasoning)
            return EventStream(events, on_close=lambda: serving.abort(choices))
        (result,) = await serving.collect(request, choices)
        output = chat_output(result.text, result.finish_reason, chat_body.tool_plan, reasoning)
        reason, sequence = stop_reason(output.finish_reason, choices[0].stop.matched)
        return JSONResponse(
            {
                **message,
                "content": content_blocks(output),
                "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": usage(choices[0]),
            }
        )

    async def _events(
        self,
        choices: list[ChoiceStream],
        message: dict,
        tools: ToolPlan,
        reasoning: ReasoningPlan | None,
    ) -> AsyncIterator[str]:
        """message_start, each block's start, deltas and stop, message_delta, message_stop. An
        error ends the stream with an `error` event; leaving it early aborts the request."""
        (choice,) = choices
        start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        try:
            yield sse_event({"type": "message_start", "message": {**start, "usage": usage(choice)}})
            output, blocks = ChatOutputStream(tools, reasoning), BlockStream()
            async with contextlib.aclosing(_interleaved(choices)) as items:
                async for item in items:
                    if isinstance(item, APIError):
                        if item.code != "server_shutdown":  # the coordinator logged the cut
                            logger.warning("stream failed: %s", item.message)
                        yield sse_event(error_body(item))
                        return
                    finished = item.finish_reason is not None
                    events = blocks.feed(output.feed(item.text, finished))
                    if finished:
                        events += blocks.close()
                    for event in events:
                        yield sse_event(event)
                    if finished:
                        reason, sequence = stop_reason(
                            output.finish_reason(item.finish_reason), choice.stop.matched
                        )
                        delta = {"stop_reason": reason, "stop_sequence": sequence}
                        yield sse_event(
                            {"type": "message_delta", "delta": delta, "usage": usage(choice)}
                        )
                        yield sse_event({"type": "message_stop"})
        finally:
            if choice.finish_reason is None:
                logger.info("stream left early: aborting its request")
            await self.serving.abort(choices)


def sse_event(data: dict) -> str:
    """One Server-Sent Event named by its data's type, as Anthropic sends them."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {data['type']}\ndata: {payload}\n\n"


def stop_reason(finish_reason: str, matched: str | None) -> tuple[str, str | None]:
    """A chat finish reason as Anthropic's stop_reason, and the stop sequence that matched."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if matched is not None:
        return "stop_sequence", matched
    return "end_turn", None


def usage(choice: ChoiceStream) -> dict:
    """input_tokens is the whole prompt (as count_tokens counts it); the prefix-cached part of
    it is cache_read_input_tokens."""
    return {
        "input_tokens": choice.num_prompt_tokens,
        "output_tokens": choice.num_output_tokens,
        "cache_read_input_tokens": choice.num_cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_id() -> str:
    return "toolu_" + new_call_id().removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object `input` is; {} for arguments cut short."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(output: ChatOutput) -> list[dict]:
    """A whole output's blocks: its thinking, its text (when not empty), its tool uses."""
    blocks: list[dict] = []
    if output.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": output.reasoning, "signature": ""})
    if output.content:
        blocks.append({"type": "text", "text": output.content})
    for call in output.calls:
        blocks.append(
            {"type": "tool_use", "id": tool_use_id(), "name": call.name,
             "input": tool_input(call.arguments)}
        )  # fmt: skip
    return blocks


class BlockStream:
    """A streamed output's OutputDeltas as content block events: one block open at a time, each
    started, added to and stopped in order (thinking, text, then each tool use)."""

    def __init__(self) -> None:
        self.index = -1  # the open block's
        self.open: str | None = None  # its type
        self.calls: dict[int, int] = {}  # a tool call's index: its block's

    def feed(self, delta: OutputDelta) -> list[dict]:
        events: list[dict] = []
        if delta.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            function = call.get("function") or {}
            if "id" in call:  # a call's first entry: its own block
                block = {"type": "tool_use", "id": tool_use_id(), "name": function.get("name")}
                events += self._start({**block, "input": {}})
                self.calls[call["index"]] = self.index
            if function.get("arguments"):
                index = self.calls.get(call["index"], self.index)
                json_delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
                events.append({"type": "content_block_delta", "index": index, "delta": json_delta})
        return events

    def close(self) -> list[dict]:
        """The open block's stop, if one is open."""
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return [
            *events,
            {"type": "content_block_start", "index": self.index, "content_block": block},
        ]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}
