"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` mean for its output,
decided before it runs, and how its output becomes `tool_calls`:

- `none`: the model writes text (the tools still reach the chat template);
- `auto`: the model decides; its calls are parsed from its own format (the server's
  `tool_call_parser`, with `enable_auto_tool_choice`);
- `required`: at least one call, enforced by a constraint: a JSON array of
  `{"name": ..., "parameters": {...}}` over the tools' parameter schemas, of one call without
  `parallel_tool_calls` and at most `CALLS_PER_TOOL` per tool with it, so the grammar closes it;
- a named function: that call, its arguments enforced by the function's parameter schema.

A request with tools and no tool_choice is `auto` where the server enables it, else `none`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from pdserve.cluster.structured_output import StructuredOutput
from pdserve.coordinator.structured_request import ConstraintRequestError, SchemaBounds
from pdserve.coordinator.tool_parsers import PARSERS, Step, ToolCall, ToolParser, array_call


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    constraint: StructuredOutput | None = None
    function: str | None = None  # named: the function called
    parser: ToolParser | None = None  # auto: the model's format
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output as (its text, its tool calls); text None when it is all calls."""
        if self.mode == "named":
            return None, [ToolCall(self.function, _compact(text))]
        if self.mode == "required":
            items = complete_items(text)
            if items is None:
                return text, []
            return None, [c for c in map(REQUIRED_CALLS.call, items) if c is not None]
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
            if not self.parallel:
                calls = calls[:1]
            return (content or None) if calls else text, calls
        return text, []


_SPACE = re.compile(r"[ \t\n\r]*")


def complete_items(text: str) -> list | None:
    """The whole items of a JSON array, also of one cut short (finish_reason length), an
    unfinished last item dropped; None when the text does not open an array."""
    decoder = json.JSONDecoder()
    at = _SPACE.match(text).end()
    if not text.startswith("[", at):
        return None
    items: list = []
    while True:
        at = _SPACE.match(text, at + 1).end()  # past "[" or ","
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items  # the array's end, or a cut item
        items.append(item)
        at = _SPACE.match(text, at).end()
        if not text.startswith(",", at):
            return items


class RequiredCalls:
    """A required choice's array of `{"name": ..., "parameters": {...}}`, read the way a stream
    reads a parser's format (`ToolParser.call`, `call_start`, `next_call`)."""

    args_key = "parameters"

    def call(self, obj: object) -> ToolCall | None:
        if not (
            isinstance(obj, dict)
            and isinstance(obj.get("name"), str)
            and isinstance(obj.get("parameters"), dict)
        ):
            return None
        return ToolCall(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))

    def call_start(self, text: str) -> int | None:
        return 0  # all of it is calls

    def next_call(self, text: str, start: int, after: int | None) -> Step:
        at = _SPACE.match(text, start).end()
        return ("wait", at) if at == len(text) else array_call(text, at, after)


REQUIRED_CALLS = RequiredCalls()


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text  # cut short (finish_reason length): as written


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# A required array's bound with parallel calls: several calls of one tool (one per city, say) are
# common, dozens are a model that does not stop; the grammar closes the array at the bound.
CALLS_PER_TOOL = 4


def plan_tools(
    tools: list[dict] | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    auto_enabled: bool,
    parser_name: str | None,
    bounds: SchemaBounds | None = None,
) -> ToolPlan:
    """The request's plan; ConstraintRequestError naming the field for what cannot be taken
    (a schema the plan compiles outside bounds among them)."""
    functions = _functions(tools or [])
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if functions and auto_enabled and parser_name else "none"
    if not functions:
        if tool_choice not in ("none", None):
            raise ConstraintRequestError("tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    if tool_choice == "none":
        return ToolPlan("none")
    if tool_choice == "auto":
        if not (auto_enabled and parser_name):
            raise ConstraintRequestError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                "--tool-call-parser",
                "tool_choice",
            )
        return ToolPlan("auto", parser=PARSERS[parser_name](), parallel=parallel)
    if tool_choice == "required":
        items = {"anyOf": [_call_schema(name, schema) for name, schema in functions.items()]}
        most = CALLS_PER_TOOL * len(functions) if parallel else 1
        array = {"type": "array", "items": items, "minItems": 1, "maxItems": most}
        if bounds is not None:
            bounds.check(array, "the schema of the tools' calls (tool_choice required)", "tools")
        return ToolPlan("required", _constraint(array), parallel=parallel)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ConstraintRequestError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in functions:
            raise ConstraintRequestError(
                f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
            )
        if bounds is not None:
            bounds.check(functions[name], f"the parameters of {name!r}", "tools")
        spec = _constraint(functions[name])
        return ToolPlan("named", spec, function=name, parallel=parallel)
    raise ConstraintRequestError(
        'tool_choice is "none", "auto", "required" or a named function', "tool_choice"
    )


def _constraint(schema: dict) -> StructuredOutput:
    """The tools' schema as a constraint; ConstraintRequestError naming `tools` if it cannot be
    one (a keyword that would not be enforced)."""
    try:
        return StructuredOutput.json_schema(schema)
    except ValueError as exc:
        raise ConstraintRequestError(f"a tool's parameters: {exc}", "tools") from None


def _functions(tools: list[dict]) -> dict[str, dict]:
    """Each function's name and parameter schema; ConstraintRequestError for a bad tool."""
    out: dict[str, dict] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise ConstraintRequestError(
                'every tool is {"type": "function", "function": {"name": ..., "parameters": '
                "{...}}}",
                "tools",
            )
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ConstraintRequestError(
                f"the parameters of {function['name']!r} are not a JSON schema", "tools"
            )
        if function["name"] in out:
            raise ConstraintRequestError(f"two tools are named {function['name']!r}", "tools")
        out[function["name"]] = parameters
    return out


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
