"""The OpenAI Responses API's request body (`POST /v1/responses`), validated strictly as the chat
body is, and its translation into the internal chat completion request every front end shares:
input items to chat messages, flat function tools to chat's nested ones, `text.format` to
`response_format`, `max_output_tokens` to `max_tokens`. Errors name the Responses field."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from pdserve.coordinator.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    Limits,
    _Body,
    bad_request,
    load_json,
    parse_body,
    validation_error,
)

# The chat request's fields and the Responses fields they came from, for errors.
CHAT_FIELDS = {
    "messages": "input",
    "response_format": "text",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "chat_template_kwargs": "reasoning",
}
# Fields of OpenAI's body that would change what the server does, which it does not do.
UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "logprobs are not supported by the Responses API here",
}


@contextlib.contextmanager
def responses_fields() -> Iterator[None]:
    """An APIError raised about the internal chat request names the Responses field instead."""
    try:
        yield
    except APIError as exc:
        if exc.param in CHAT_FIELDS:
            new = CHAT_FIELDS[exc.param]
            exc.message = exc.message.replace(exc.param, new)
            exc.message = exc.message.replace("response_format", "text.format")
            exc.param = new
        raise


def parse_responses_body(raw: bytes, limits: Limits) -> ResponsesRequest:
    """The body as a ResponsesRequest, or the 400 naming its field; an input item's error says
    which item (`input[2].call_id`)."""
    data = load_json(raw)
    try:
        body = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = first["loc"]
        if len(loc) < 3 or loc[:2] != ("input", "items"):
            raise validation_error(exc) from None
        # ("input", "items", 2, "function_call_output", "call_id"): the tags are no field
        where = f"input[{loc[2]}]" + "".join(f".{p}" for p in loc[4:] if isinstance(p, str))
        if first["type"] == "missing":
            raise bad_request(
                f"'{where}' is required", "input", "missing_required_parameter"
            ) from None
        raise bad_request(f"Invalid '{where}': {first['msg']}", "input") from None
    body.check(limits)
    return body


class _Item(BaseModel):
    # Items a client sends back from a response carry ids and statuses: ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextContent(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextContent]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(_Item):
    """A previous response's reasoning, sent back with its output: not shown to the model again,
    as chat templates drop past turns' reasoning."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_value",
        custom_error_message="an input item's type is message, function_call, "
        "function_call_output or reasoning",
    ),
]
# A string, or items (one tag per shape, so an error names the shape sent).
Input = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
    Discriminator(
        lambda v: "text" if isinstance(v, str) else "items" if isinstance(v, list) else None,
        custom_error_type="invalid_type",
        custom_error_message="input is a string or an array of input items",
    ),
]


class TextFormat(_Item):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Item):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Item):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: Input
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    def check(self, limits: Limits) -> None:
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must be a string or a non-empty array of items", "input")
        for name, message in UNSUPPORTED.items():
            if getattr(self, name) not in (None, False, 0):
                raise bad_request(message, name, "unsupported_parameter")
        if self.truncation == "auto":
            raise bad_request(
                'truncation "auto" is not supported: an input past the context is refused',
                "truncation",
                "unsupported_parameter",
            )
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise bad_request(
                    f"tools[{i}]: only function tools are supported, not {kind!r}",
                    "tools",
                    "unsupported_parameter",
                )
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise bad_request(f"tools[{i}] is a function tool without a name", "tools")
        if self.metadata is not None and len(self.metadata) > 16:
            raise bad_request("metadata holds at most 16 pairs", "metadata")

    # --- translation ---------------------------------------------------------------------------

    def input_messages(self) -> list[dict]:
        """This request's input as chat messages (without its instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input)

    def chat_request(self, history: list[dict], limits: Limits) -> ChatCompletionRequest:
        """The internal chat request: instructions, then history (a previous response's
        conversation), then this input; checked as a chat body is, errors naming our fields."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += history + self.input_messages()
        data: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": bool(self.stream),
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tools": [chat_tool(t) for t in self.tools] if self.tools else None,
            "tool_choice": chat_tool_choice(self.tool_choice),
            "response_format": self.response_format(),
        }
        data.update({k: v for k, v in optional.items() if v is not None})
        if self.reasoning is not None and self.reasoning.effort is not None:
            data["chat_template_kwargs"] = {"enable_thinking": self.reasoning.effort != "none"}
        with responses_fields():
            return parse_body(data, ChatCompletionRequest, limits)

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text")
        inner = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.strict is not None:
            inner["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": inner}


def chat_tool(tool: dict) -> dict:
    """A flat Responses function tool in chat's nested form."""
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            'tool_choice is "none", "auto", "required" or {"type": "function", "name": ...}',
            "tool_choice",
            "unsupported_parameter",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def items_to_messages(items: list) -> list[dict]:
    """Input items as chat messages: function calls join the assistant message before them (or
    start one), their outputs become `tool` messages, reasoning items are dropped."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a follow-up's prompt carries."""
    content = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def echo(body: ResponsesRequest) -> dict:
    """The request's fields a response object repeats."""
    fmt = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
    return {
        "instructions": body.instructions,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "text": {"format": fmt},
        "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
        "metadata": body.metadata or {},
        "store": body.store is not False,
        "truncation": "disabled",
        "background": False,
    }
