"""Which constraint a request asks for, from the fields OpenAI and vLLM clients send: OpenAI's
`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`) and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`. At most one of them; what is wrong with it is a 400 naming the field. The nodes
compile it (`pdserve.engine.grammar`); what only the compiler can tell comes back from them."""

from __future__ import annotations

import json
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


def requested_constraint(
    response_format: dict | None,
    structured_outputs: dict | None,
    guided: dict[str, Any],
) -> tuple[StructuredOutput | None, str | None]:
    """(the constraint, the field it came from), or (None, None) when there is none."""
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
            return _response_format(value), param
        if param == "structured_outputs":
            return _structured_outputs(value), param
        return _made(GUIDED[param], value), param
    except ValueError as exc:
        raise ConstraintRequestError(str(exc), param) from None


def _response_format(value: dict) -> StructuredOutput:
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
    return _made("json", inner["schema"])


def _structured_outputs(value: dict) -> StructuredOutput:
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise ValueError(
            f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}, got "
            f"{', '.join(kinds) or 'none'}"
        )
    return _made(kinds[0], value[kinds[0]])


def _made(kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
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
