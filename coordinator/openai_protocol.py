"""The OpenAI-compatible request bodies (validated strictly: a wrong type is an error, never
coerced; an unknown field is ignored, as vLLM does; sizes bounded by the coordinator's limits)
and the error every refusal carries: its status, headers and OpenAI error body."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from pdserve.cluster.structured_output import StructuredOutput
from pdserve.coordinator.structured_request import (
    GUIDED,
    ConstraintRequestError,
    SchemaBounds,
    requested_constraint,
)
from pdserve.coordinator.tool_choice import ToolPlan, plan_tools

logger = logging.getLogger(__name__)

INT64 = 2**63
RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait


class APIError(Exception):
    """A refusal: its status, and the OpenAI error body `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def coordinator_error(code: str, message: str) -> APIError:
    """What the coordinator refused or failed with (a SubmitError's or an error event's code:
    invalid | overloaded | unavailable | shutdown | timeout | internal), as the client sees it."""
    if code == "invalid":
        return bad_request(message)
    if code == "overloaded":
        return APIError(
            429, message, "server_overloaded", code="overloaded", retry_after=RETRY_AFTER_S
        )
    if code == "unavailable":
        return APIError(
            503, message, "service_unavailable", code="unavailable", retry_after=RETRY_AFTER_S
        )
    if code == "shutdown":  # another replica may serve it: worth a retry
        return APIError(
            503, message, "server_shutdown", code="server_shutdown", retry_after=RETRY_AFTER_S
        )
    if code == "timeout":
        return APIError(504, message, "timeout_error", code="timeout")
    return APIError(500, message, "server_error", code="internal_error")


# --- requests --------------------------------------------------------------------------------


class Limits(Protocol):
    """The bounds a body is checked against (the coordinator's config holds them)."""

    max_n: int
    max_logprobs: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_logit_bias: int
    max_json_schema_bytes: int
    max_json_schema_depth: int


def schema_bounds(limits: Limits) -> SchemaBounds:
    return SchemaBounds(limits.max_json_schema_bytes, limits.max_json_schema_depth)


def at_most(value: int | None, limit: int, param: str) -> None:
    if value is not None and value > limit:
        raise bad_request(f"'{param}' must be at most {limit}, got {value}", param)


class _Body(BaseModel):
    # Unknown fields are ignored (clients send extras such as `user`); known ones are strict.
    # NaN and infinities (which Python's JSON reader takes) are no valid value of any field.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    def check(self, limits: Limits) -> None:
        """Rules across fields and bounds, checked after the fields themselves; a 400 if one is
        broken."""


Body = TypeVar("Body", bound=_Body)


def load_json(raw: bytes) -> dict[str, Any]:
    """A request body's JSON object, or the 400 that says why it is none."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"The body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The body must be a JSON object", code="invalid_type")
    return data


def parse_body(
    data: bytes | dict[str, Any], model: type[Body], limits: Limits | None = None
) -> Body:
    """A request body (raw, or its JSON object) as `model`, or the 400 that says what is wrong
    with it (limits: the coordinator's config, or its defaults). Fields the model does not know
    are ignored, with a debug line naming them."""
    if not isinstance(data, dict):
        data = load_json(data)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    unknown = sorted(set(data) - set(model.model_fields))
    if unknown:
        logger.debug("ignored unknown fields %s", ", ".join(unknown))
    if limits is None:
        from pdserve.coordinator.config import CoordinatorConfig

        limits = CoordinatorConfig()
    body.check(limits)
    return body


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields common to completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(1, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # Constraints (`pdserve.coordinator.structured_request`): at most one.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _schema_bounds: SchemaBounds | None = PrivateAttr(default=None)  # set when checked

    def constraint(self) -> tuple[StructuredOutput | None, str | None]:
        """The constraint the body asks for and the field it is in (400 naming the field if it
        cannot be taken)."""
        guided = {name: getattr(self, name) for name in GUIDED}
        try:
            return requested_constraint(
                self.response_format, self.structured_outputs, guided, self._schema_bounds
            )
        except ConstraintRequestError as exc:
            raise bad_request(str(exc), exc.param) from None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check(self, limits: Limits) -> None:
        """Rules across fields, bounds, and what is refused rather than silently ignored."""
        at_most(self.n, limits.max_n, "n")
        stops = self.stop_strings
        if len(stops) > limits.max_stop_strings:
            raise bad_request(
                f"at most {limits.max_stop_strings} stop strings, got {len(stops)}", "stop"
            )
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_string_chars:
            raise bad_request(
                f"a stop string is at most {limits.max_stop_string_chars} "
                f"characters, got {longest}",
                "stop",
            )
        if self.logit_bias and len(self.logit_bias) > limits.max_logit_bias:
            raise bad_request(
                f"at most {limits.max_logit_bias} logit_bias entries, got {len(self.logit_bias)}",
                "logit_bias",
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options may only be set when stream is true", "stream_options"
            )
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        self._schema_bounds = schema_bounds(limits)
        self.constraint()


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check(self, limits: Limits) -> None:
        super().check(limits)
        at_most(self.logprobs, limits.max_logprobs, "logprobs")
        at_most(self.best_of, limits.max_n, "best_of")
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n (or be omitted)", "best_of")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ... go through

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content as one string."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        else:
            d["content"] = self.content or ""
        # Templates read a call's arguments as a mapping; OpenAI sends them as JSON text.
        for call in d.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # the template gets the text as sent
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # More variables for the chat template (vLLM's): `enable_thinking` among them.
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # (vLLM's) false: the reasoning is parsed out, not returned
    _tool_plan: ToolPlan = PrivateAttr(default_factory=lambda: ToolPlan("none"))

    @property
    def tool_plan(self) -> ToolPlan:
        """What the tools mean for the output (set when the body is checked)."""
        return self._tool_plan

    def constraint(self) -> tuple[StructuredOutput | None, str | None]:
        spec, param = super().constraint()
        tool_spec = self._tool_plan.constraint
        if tool_spec is None:
            return spec, param
        if spec is not None:
            raise bad_request(
                f"{param} cannot be given with a required or named tool_choice", param
            )
        return tool_spec, "tools"

    def check(self, limits: Limits) -> None:
        try:
            self._tool_plan = plan_tools(
                self.tools, self.tool_choice, self.parallel_tool_calls,
                getattr(limits, "enable_auto_tool_choice", False),
                getattr(limits, "tool_call_parser", None),
                schema_bounds(limits),
            )  # fmt: skip
        except ConstraintRequestError as exc:
            raise bad_request(str(exc), exc.param) from None
        super().check(limits)
        at_most(self.top_logprobs, limits.max_logprobs, "top_logprobs")
        if not self.messages:
            raise bad_request("messages must be a non-empty array", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        check_template_kwargs(self.chat_template_kwargs)


# What the server itself gives the chat template: a request's chat_template_kwargs may not.
RESERVED_TEMPLATE_VARIABLES = (
    "messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
)  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    taken = sorted(set(kwargs or ()) & set(RESERVED_TEMPLATE_VARIABLES))
    if taken:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do",
            "chat_template_kwargs",
        )


class TokenizeCompletionRequest(_Body):
    """`POST /tokenize` of a prompt, as vLLM takes it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """`POST /tokenize` of chat messages through the chat template, as vLLM takes it."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self, limits: Limits) -> None:
        if not self.messages:
            raise bad_request("messages must be a non-empty array", "messages")
        check_template_kwargs(self.chat_template_kwargs)


class DetokenizeRequest(_Body):
    """`POST /detokenize`: token ids back to text."""

    model: str | None = None
    tokens: list[int]


# --- validation errors -----------------------------------------------------------------------

# What a field of several accepted shapes expects, for its error message.
_EXPECTED = {
    "prompt": "a string, an array of strings, an array of token ids or an array of token-id arrays",
    "stop": "a string or an array of strings",
    "messages": "an array of messages, each with a role and text content",
}


def _path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def validation_error(exc: ValidationError) -> APIError:
    """The first offending field of a body as one OpenAI-style 400."""
    errors = exc.errors(include_url=False)
    param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
    mine = [e for e in errors if e["loc"] and str(e["loc"][0]) == param]
    first = mine[0] if mine else errors[0]
    kind = first["type"]
    if kind == "missing":
        return bad_request(f"'{param}' is required", param, "missing_required_parameter")
    code = (
        "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    )
    if len(mine) > 1 and param in _EXPECTED:  # every shape of a union failed
        return bad_request(f"Invalid '{param}': expected {_EXPECTED[param]}", param, code)
    return bad_request(f"Invalid '{_path(first['loc'])}': {first['msg']}", param, code)
