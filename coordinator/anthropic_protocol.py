"""Anthropic's Messages API bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), validated
strictly, their translation into the internal chat request every front end shares, and
Anthropic's error body `{"type": "error", "error": {"type", "message"}}` for every refusal."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from pdserve.coordinator.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    Limits,
    _Body,
    bad_request,
    load_json,
    parse_body,
)

MESSAGES_PATH = "/v1/messages"  # and below it, count_tokens: their errors are Anthropic's

# The error `type` a status is, as Anthropic names them.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Chat fields an error may name, as the Messages API calls them.
FIELD_NAMES = {
    "stop": "stop_sequences",
    "chat_template_kwargs": "thinking",
    "max_completion_tokens": "max_tokens",
    "parallel_tool_calls": "tool_choice",
    "response_format": "output_config.format",
}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(exc: APIError) -> dict:
    """A refusal in Anthropic's shape; its message names the field it is about."""
    kind = ERROR_TYPES.get(
        exc.status, "api_error" if exc.status >= 500 else "invalid_request_error"
    )
    param = FIELD_NAMES.get(exc.param, exc.param) if exc.param else None
    message = exc.message
    if param is not None and exc.param not in message and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# --- content blocks ----------------------------------------------------------------------------


class TextBlockParam(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        text = _text(self.content or "")
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_Body):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


def _text(content: str | list[TextBlockParam]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict]:
        """The message as chat messages: a user's tool results each a `tool` message (first, as
        Anthropic sends them first), an assistant's tool uses its `tool_calls`; past thinking
        dropped (the template renders what it keeps of it)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlockParam))
        if self.role == "assistant":
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in self.content
                if isinstance(b, ToolUseBlockParam)
            ]
            message: dict = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            return [message]
        out = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in self.content
            if isinstance(b, ToolResultBlockParam)
        ]
        if text or not out:
            out.append({"role": "user", "content": text})
        return out

    def check_blocks(self, index: int) -> None:
        """A 400 for a block its role cannot send."""
        wrong = (
            (ToolResultBlockParam,)
            if self.role == "assistant"
            else (ToolUseBlockParam, ThinkingBlockParam)
        )
        for i, block in enumerate(self.content if isinstance(self.content, list) else ()):
            if isinstance(block, wrong):
                raise bad_request(
                    f"messages[{index}].content[{i}]: a {self.role} message cannot hold a "
                    f"{block.type} block",
                    "messages",
                )


# --- tools, tool_choice, thinking --------------------------------------------------------------


class ToolParam(_Body):
    name: str = Field(min_length=1)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None

    def chat_tool(self) -> dict:
        function: dict = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoiceAutoParam(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAnyParam(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceToolParam(_Body):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNoneParam(_Body):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAutoParam | ToolChoiceAnyParam | ToolChoiceToolParam | ToolChoiceNoneParam,
    Field(discriminator="type"),
]


class ThinkingConfigEnabledParam(_Body):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingConfigAdaptiveParam(_Body):
    type: Literal["adaptive"]


class ThinkingConfigDisabledParam(_Body):
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingConfigEnabledParam | ThinkingConfigAdaptiveParam | ThinkingConfigDisabledParam,
    Field(discriminator="type"),
]


class JSONOutputFormatParam(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(_Body):
    format: JSONOutputFormatParam | None = None
    effort: str | None = None  # accepted, unused


# --- the bodies --------------------------------------------------------------------------------


class CountTokensRequest(_Body):
    """`POST /v1/messages/count_tokens`: what the prompt of a message is made of."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def check(self, limits: Limits) -> None:
        if not self.messages:
            raise bad_request("messages: must be a non-empty array", "messages")
        for i, message in enumerate(self.messages):
            message.check_blocks(i)

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields this body gives."""
        messages = []
        if self.system is not None:
            messages.append({"role": "system", "content": _text(self.system)})
        for message in self.messages:
            messages += message.chat_messages()
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools is not None:
            fields["tools"] = [t.chat_tool() for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = {
                "auto": "auto",
                "any": "required",
                "none": "none",
                "tool": {"type": "function", "function": {"name": getattr(choice, "name", "")}},
            }[choice.type]
            if getattr(choice, "disable_parallel_tool_use", None):
                fields["parallel_tool_calls"] = False
        if self.thinking is not None:
            thinks = self.thinking.type != "disabled"
            fields["chat_template_kwargs"] = {"enable_thinking": thinks}
        return fields

    def chat_request(self, limits: Limits | None) -> ChatCompletionRequest:
        """The chat request this body is, through chat's own checks (its errors named as this
        API names the fields)."""
        return parse_body(self.chat_fields(), ChatCompletionRequest, limits)


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    output_config: OutputConfigParam | None = None
    metadata: dict[str, Any] | None = None  # accepted, unused

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        fields["max_tokens"] = self.max_tokens
        fields["stream"] = self.stream
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.top_k:  # 0: no top-k
            fields["top_k"] = self.top_k
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.json_schema
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        return fields


def parse_messages_body(
    raw: bytes, model: type[CountTokensRequest], limits: Limits | None
) -> tuple[CountTokensRequest, ChatCompletionRequest]:
    """A Messages API body and the chat request it becomes, or the 400 naming what is wrong."""
    data = load_json(raw)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    body.check(limits)
    return body, body.chat_request(limits)


# --- validation errors -------------------------------------------------------------------------


def _path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "str" or "[" in part:  # which branch of a union: not a field
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error(exc: ValidationError) -> APIError:
    """The first offending field, at its most specific (the deepest error under it), as a 400
    whose message is its path."""
    errors = exc.errors(include_url=False)
    param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
    mine = [e for e in errors if e["loc"] and str(e["loc"][0]) == param] or errors
    first = max(mine, key=lambda e: len(e["loc"]))
    path = _path(first["loc"])
    if first["type"] == "missing":
        return bad_request(f"{path}: Field required", param, "missing_required_parameter")
    return bad_request(f"{path}: {first['msg']}", param)
