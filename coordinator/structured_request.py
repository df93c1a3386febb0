"""Which constraint a request asks for, from the fields OpenAI and vLLM clients send: OpenAI's
`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`) and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`. At most one of them; what is wrong with it is a 400 naming the field. The nodes
compile it (`pdserve.engine.grammar`); what only the compiler can tell comes back from them.
A JSON schema's size and nesting are bounded here (`SchemaBounds`), before it reaches a node."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.structured_output import StructuredOutput

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


class ConstraintRequestError(ValueError):
    """A constraint field that cannot be taken: the message, and the field (`param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# Keywords whose value maps names to schemas: the map is no level of nesting, its schemas are.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class SchemaBounds:
    """How large a JSON schema may be (bytes of its JSON text) and how deeply its schemas may
    nest: compile time grows with both, and a node compiles one grammar at a time."""

    max_bytes: int
    max_depth: int

    def check(self, schema: Any, what: str, param: str) -> None:
        """ConstraintRequestError naming the limit (and its flag) if the schema breaks one.
        what: the schema as the message names it ("response_format json_schema")."""
        if isinstance(schema, str):
            self._check_size(len(schema.encode()), what, param)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                return  # not JSON: said when the constraint is made
        # Depth first: its count stops at the limit, where serializing would not.
        if schema_depth(schema, self.max_depth + 1) > self.max_depth:
            raise ConstraintRequestError(
                f"{what} has schemas nested more than {self.max_depth} deep; the limit is "
                f"{self.max_depth} (--max-json-schema-depth)",
                param,
            )
        self._check_size(len(json.dumps(schema)), what, param)

    def _check_size(self, size: int, what: str, param: str) -> None:
        if size > self.max_bytes:
            raise ConstraintRequestError(
                f"{what} is {size} bytes; the limit is {self.max_bytes} (--max-json-schema-bytes)",
                param,
            )


def schema_depth(schema: Any, stop: int) -> int:
    """How deeply the schema's (sub)schemas nest: 1 for a schema without subschemas; counted no
    further than stop, so a schema nested thousands deep costs no more than one at stop."""
    if stop <= 0:
        return 0
    if isinstance(schema, list):
        return max((schema_depth(item, stop) for item in schema), default=0)
    if not isinstance(schema, dict):
        return 0
    deepest = 0
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        if key in SCHEMA_MAPS and isinstance(value, dict):
            value = list(value.values())
        deepest = max(deepest, schema_depth(value, stop - 1))
        if deepest >= stop - 1:
            break
    return 1 + deepest


def requested_constraint(
    response_format: dict | None,
    structured_outputs: dict | None,
    guided: dict[str, Any],
    bounds: SchemaBounds | None = None,
) -> tuple[StructuredOutput | None, str | None]:
    """(the constraint, the field it came from), or (None, None) when there is none; a JSON
    schema outside bounds is refused before it is parsed further."""
    asked: list[tuple[str, Any]] = []
    if response_format is not None and response_format.get("type", "text") != "text":
        asked.append(("response_format", response_format))
    if structured_outputs:
        asked.append(("structured_outputs", structured_outputs))
    asked += [(name, value) for name, value in guided.items() if value is not None]
    if not asked:
        return None, None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise ConstraintRequestError(
            f"at most one constraint per request, got {names}", asked[1][0]
        )
    param, value = asked[0]
    try:
        if param == "response_format":
            return _response_format(value, bounds), param
        if param == "structured_outputs":
            return _structured_outputs(value, bounds), param
        return _made(GUIDED[param], value, bounds, param), param
    except ValueError as exc:
        raise ConstraintRequestError(str(exc), param) from None


def _response_format(value: dict, bounds: SchemaBounds | None) -> StructuredOutput:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutput.any_json_object()
    if kind != "json_schema":
        raise ValueError(
            f"response_format type must be text, json_object or json_schema, got {kind!r}"
        )
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise ValueError("response_format json_schema needs a json_schema object with a schema")
    return _made("json", inner["schema"], bounds, "response_format json_schema")


def _structured_outputs(value: dict, bounds: SchemaBounds | None) -> StructuredOutput:
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise ValueError(
            f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}, got "
            f"{', '.join(kinds) or 'none'}"
        )
    return _made(kinds[0], value[kinds[0]], bounds, f"structured_outputs {kinds[0]}")


def _made(kind: str, value: Any, bounds: SchemaBounds | None, what: str) -> StructuredOutput:
    if kind == "json":
        if bounds is not None:
            bounds.check(value, what, what.split()[0])
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(value, dict | bool):
            raise ValueError("a JSON schema is an object")
        return StructuredOutput.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list):
            raise ValueError("choice is a list of strings")
        return StructuredOutput(kind="choice", choices=value)
    if not isinstance(value, str):
        raise ValueError(f"{kind} is a string")
    return StructuredOutput(kind=kind, spec=value)
