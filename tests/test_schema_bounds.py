"""A JSON schema's size and nesting are bounded at the coordinator (`SchemaBounds`): a schema
over `max_json_schema_bytes` or nested deeper than `max_json_schema_depth`, through
response_format, vLLM's fields or a forced tool's parameters, is a 400 naming the limit and its
flag, before it is routed; one just under the limits is taken."""

from __future__ import annotations

import json

import pytest

from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from pdserve.coordinator.structured_request import schema_depth

HI = [{"role": "user", "content": "Hi"}]


def nested(depth: int) -> dict:
    """An object schema whose schemas nest `depth` deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def wide(properties: int, description_chars: int = 250) -> dict:
    names = [f"p{i}" for i in range(properties)]
    described = {"type": "string", "description": "x" * description_chars}
    return {"type": "object", "properties": dict.fromkeys(names, described), "required": names}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def forced_tool(schema: dict, choice: str | dict) -> dict:
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    return {"tools": tools, "tool_choice": choice}


def refusal(body: dict, config: CoordinatorConfig | None = None, model=ChatCompletionRequest):
    with pytest.raises(APIError) as info:
        parse_body(body, model, config)
    assert info.value.status == 400
    return info.value.body()["error"]


def test_depth_counts_nested_schemas_not_maps_or_values():
    assert schema_depth({"type": "string"}, 99) == 1
    assert schema_depth(nested(5), 99) == 5
    assert schema_depth({"anyOf": [nested(3), {"type": "null"}]}, 99) == 4
    assert schema_depth({"$defs": {"a": nested(4)}, "$ref": "#/$defs/a"}, 99) == 5
    assert schema_depth({"enum": [{"a": {"b": {"c": 1}}}]}, 99) == 1
    assert schema_depth(nested(5000), 10) == 10  # counts no further than asked


def test_the_reported_schemas_are_refused_by_default_naming_the_limit():
    big = wide(3000)  # about 840 KB, 3,000 required properties
    error = refusal({"messages": HI, "response_format": response_format(big)})
    assert error["param"] == "response_format"
    size = len(json.dumps(big))
    assert error["message"] == (
        f"response_format json_schema is {size} bytes; the limit is 65536 (--max-json-schema-bytes)"
    )
    error = refusal({"messages": HI, "response_format": response_format(nested(300))})
    assert error["param"] == "response_format"
    assert "the limit is 32 (--max-json-schema-depth)" in error["message"]


def test_vllms_fields_are_bounded_alike():
    for body in (
        {"guided_json": nested(40)},
        {"guided_json": json.dumps(nested(40))},
        {"structured_outputs": {"json": nested(40)}},
    ):
        error = refusal({"prompt": "Once", **body}, model=CompletionRequest)
        assert error["param"] == next(iter(body)) and "--max-json-schema-depth" in error["message"]
    error = refusal(
        {"prompt": "Once", "guided_json": json.dumps(wide(300))}, None, CompletionRequest
    )
    assert "--max-json-schema-bytes" in error["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_tools_parameters_are_bounded(choice):
    error = refusal({"messages": HI, **forced_tool(nested(300), choice)})
    assert error["param"] == "tools" and "--max-json-schema-depth" in error["message"]
    error = refusal({"messages": HI, **forced_tool(wide(3000), choice)})
    assert error["param"] == "tools" and "--max-json-schema-bytes" in error["message"]


def test_schemas_just_under_the_default_limits_are_taken():
    under = wide(215)  # just under 64 KiB
    assert 60_000 < len(json.dumps(under)) <= 65536
    for schema in (under, nested(32)):
        body = parse_body({"messages": HI, "response_format": response_format(schema)},
                          ChatCompletionRequest)  # fmt: skip
        assert body.constraint()[0] is not None
    named = {"type": "function", "function": {"name": "f"}}
    parse_body({"messages": HI, **forced_tool(nested(32), named)}, ChatCompletionRequest)
    parse_body({"messages": HI, **forced_tool(nested(29), "required")}, ChatCompletionRequest)


def test_the_limits_are_the_coordinators_settings():
    config = CoordinatorConfig(max_json_schema_bytes=200, max_json_schema_depth=3)
    small = {"type": "object", "properties": {"name": {"type": "string"}}}
    parse_body({"messages": HI, "response_format": response_format(small)},
               ChatCompletionRequest, config)  # fmt: skip
    error = refusal({"messages": HI, "response_format": response_format(wide(3, 40))}, config)
    assert "the limit is 200 (--max-json-schema-bytes)" in error["message"]
    error = refusal({"messages": HI, "response_format": response_format(nested(4))}, config)
    assert "the limit is 3 (--max-json-schema-depth)" in error["message"]
