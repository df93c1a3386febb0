"""A request's structured-output constraint as it travels with the request to every node that
samples for it: a JSON schema, a regular expression, a list of choices or an EBNF grammar. Each
node compiles it for its own tokenizer (`pdserve.engine.grammar`); what can be checked without
the compiler is checked here, when the constraint is made or decoded off the wire.

A reasoning model's constraint applies to its answer only: `after` holds the token ids that end
its reasoning (`</think>`), and the grammar begins after their first occurrence in the output."""

from __future__ import annotations

import json
import re

import msgspec

KINDS = ("json", "regex", "choice", "grammar")
# JSON Schema keywords the compiler (xgrammar 0.2.8) accepts but does not enforce: a schema that
# uses one is refused, naming it, rather than served output that may break it.
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
)
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar this large is junk, not a constraint
MAX_AFTER_TOKENS = 16  # a reasoning end marker is a token or a few


class StructuredOutput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    kind: str  # json | regex | choice | grammar
    spec: str = ""  # the JSON schema (as JSON text), the regex or the EBNF grammar
    choices: list[str] = []  # kind choice: the output is exactly one of them
    # The grammar begins after the first occurrence of these tokens in the output (the end of
    # its reasoning); empty: at the output's start.
    after: list[int] = []

    def __post_init__(self) -> None:
        if len(self.after) > MAX_AFTER_TOKENS or not all(
            isinstance(t, int) and 0 <= t < 2**31 for t in self.after
        ):
            raise ValueError(f"after is at most {MAX_AFTER_TOKENS} token ids")
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"a structured output spec is at most {MAX_SPEC_CHARS} characters")
        if self.kind == "choice":
            if not self.choices:
                raise ValueError("a choice constraint needs at least one choice")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("every choice must be a non-empty string")
        elif self.choices:
            raise ValueError("choices are for a choice constraint only")
        elif self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object (or true)")
            unenforced = _unenforced(schema)
            if unenforced:
                raise ValueError(f"the JSON schema uses {unenforced}, which is not supported")
        elif self.kind == "regex":
            if not self.spec:
                raise ValueError("the regex is empty")
            try:
                re.compile(self.spec)
            except re.error as exc:
                raise ValueError(f"the regex does not compile: {exc}") from None
        elif not self.spec.strip():
            raise ValueError("the grammar is empty")

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the compiled grammar: equal keys compile to the same grammar (where
        it begins is no part of it)."""
        return (self.kind, self.spec, tuple(self.choices))

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredOutput:
        return cls(kind="json", spec=json.dumps(schema))  # (its properties' order is the output's)

    @classmethod
    def any_json_object(cls) -> StructuredOutput:
        return cls.json_schema({"type": "object"})


def _unenforced(schema: object) -> str | None:
    """The first keyword of the schema (at any depth) that would not be enforced, or None."""
    if isinstance(schema, list):
        return next((found for item in schema if (found := _unenforced(item))), None)
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            if isinstance(value, dict):  # (names of properties are not keywords)
                found = next((f for v in value.values() if (f := _unenforced(v))), None)
                if found:
                    return found
            continue
        if key in UNENFORCED_KEYWORDS:
            return f"'{key}'"
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            return f"a remote $ref ({value})"
        if key not in ("enum", "const", "default", "examples"):
            found = _unenforced(value)
            if found:
                return found
    return None
