"""One tool call's JSON object read as the model writes it: its name once that string is whole,
where its arguments object begins and how far it has been written, and where the object ends."""

from __future__ import annotations

import json


class CallScanner:
    """Fed the growing text, it reads on from where it stopped (strings, escapes and nesting
    depth), so a call's arguments can stream before the object is whole. It only finds spans;
    whether the object is a call is for `json.loads` once it has ended."""

    def __init__(self, start: int, args_key: str) -> None:
        self.start = start  # the object's "{"
        self.pos = start  # the next character to read
        self.end: int | None = None  # past the object's "}"
        self.name: str | None = None
        self.args_start: int | None = None  # the arguments object, when the name came before it
        self.args_end: int | None = None
        self.args_key = args_key
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "key"  # in the object itself: key | colon | value | in value | comma
        self._token = 0  # where the key or value being read began
        self._key: str | None = None
        self._value_key: str | None = None

    @property
    def args_written(self) -> int | None:
        """How far the arguments streamed as written go (None: they are not streamed so)."""
        if self.args_start is None:
            return None
        return self.args_end if self.args_end is not None else self.pos

    def feed(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end is None:
            ch = text[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 1:
                        self._string_end(text, i)
            elif ch == '"':
                self._in_string = True
                if self._depth == 1:
                    self._token_start(text, i - 1)
            elif ch in "{[":
                if self._depth == 1:
                    self._token_start(text, i - 1)
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = i
                elif self._depth == 1 and self._expect == "in value":
                    self._value_end(text, i)
            elif self._depth == 1:
                if ch == ":":
                    self._expect = "value"
                elif ch == ",":
                    self._expect = "key"
                elif not ch.isspace() and self._expect == "value":
                    self._token_start(text, i - 1)  # a number, true, false or null
        self.pos = i

    def _token_start(self, text: str, at: int) -> None:
        self._token = at
        if self._expect != "value":
            return
        self._expect, self._value_key = "in value", self._key
        # Only the first arguments object after the name streams as written; the rest (arguments
        # as a JSON string, the name after them, the other key) go out whole once parsed.
        # A repeated key that json.loads would take instead is not caught here.
        if (
            self._key == self.args_key
            and text[at] == "{"
            and self.name is not None
            and self.args_start is None
        ):
            self.args_start = at

    def _string_end(self, text: str, end: int) -> None:
        if self._expect == "key":
            self._key = _string(text[self._token : end])
            self._expect = "colon"
        elif self._expect == "in value":
            self._value_end(text, end)

    def _value_end(self, text: str, end: int) -> None:
        self._expect = "comma"
        if self._value_key == "name" and self.name is None and text[self._token] == '"':
            self.name = _string(text[self._token : end])
        if self.args_start == self._token:
            self.args_end = end


def _string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
