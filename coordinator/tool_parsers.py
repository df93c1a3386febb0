"""Tool calls in a model's own output format, as vLLM's `--tool-call-parser` names them: each
parser splits an output into its text and its calls, and says where in a stream the calls may
begin (the text before that streams as content) and where each call's JSON object begins, so a
stream can send each call's arguments as the model writes them.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Qwen2.5, Qwen3, Hermes).
- `llama3_json`: `{"name": ..., "parameters": {...}}`, calls separated by `;`, the output
  optionally opening with `<|python_tag|>` (Llama 3.1 and later).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments as a JSON object's text


def _call(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


# A step through a stream's calls: ("object", where the next call's "{" is), ("wait", ...) until
# more text comes, ("end", ...) after the last call, or ("fail", where the text stops being calls).
Step = tuple[str, int]


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def array_call(text: str, opening: int, after: int | None) -> Step:
    """The next call of a JSON array of calls whose "[" is at opening; after: the end of the
    last call's object (None before the first)."""
    if text[opening] != "[":
        return "fail", opening
    if after is None:
        at = _skip_space(text, opening + 1)
    else:
        at = _skip_space(text, after)
        if at == len(text):
            return "wait", at
        if text[at] == "]":
            return "end", at + 1
        if text[at] != ",":
            return "fail", after
        at = _skip_space(text, at + 1)
    if at == len(text):
        return "wait", at
    return ("object", at) if text[at] == "{" else ("fail", after if after is not None else opening)


class ToolParser:
    """Splits an output into (its text, its tool calls); text that looks like a call but does
    not parse stays text."""

    name: str
    args_key = "arguments"

    def call(self, obj: object) -> ToolCall | None:
        """The call one of this format's JSON objects is (None: it is not one)."""
        return _call(obj, self.args_key)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where calls may begin in the text so far (None: not yet); a stream shows the text
        before it as content, holding back a tail that may be the start of a marker."""
        raise NotImplementedError


def _marker_start(text: str, marker: str) -> int | None:
    """The marker's position, or where a partial marker at the end of text begins."""
    found = text.find(marker)
    if found >= 0:
        return found
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return None


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls = []
        for body in self.BLOCK.findall(text[start:]):
            try:
                call = self.call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].rstrip(), calls

    def call_start(self, text: str) -> int | None:
        return _marker_start(text, self.OPEN)

    def next_call(self, text: str, start: int, after: int | None) -> Step:
        at = start
        if after is None:
            if not text.startswith(self.OPEN, at):
                return "wait", at  # a partial marker, or not one
        else:
            at = _skip_space(text, after)
            if self.CLOSE.startswith(text[at : at + len(self.CLOSE)]) and (
                len(text) - at < len(self.CLOSE)
            ):
                return "wait", at  # the closing marker may be coming
            if not text.startswith(self.CLOSE, at):
                return "fail", after  # more than a call in its block
            at = text.find(self.OPEN, at + len(self.CLOSE))  # parse skips text between blocks
            if at < 0:
                return "wait", after
        body = _skip_space(text, at + len(self.OPEN))
        if body == len(text):
            return "wait", at
        return ("object", body) if text[body] == "{" else ("fail", at)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    args_key = "parameters"
    SEPARATORS = " \n\t;"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = self.call(obj)
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in self.SEPARATORS:
                i += 1
        return "", calls

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return None
        if stripped.startswith("{") or self.TAG.startswith(stripped[: len(self.TAG)]):
            return len(text) - len(stripped)
        return None

    def next_call(self, text: str, start: int, after: int | None) -> Step:
        if after is None:
            if text.startswith(self.TAG, start):
                start += len(self.TAG)
            elif text[start] != "{":
                return "wait", start  # a partial tag, or not one
            at = _skip_space(text, start)
        else:
            at = after
            while at < len(text) and text[at] in self.SEPARATORS:
                at += 1
        if at == len(text):
            return "wait", at
        return ("object", at) if text[at] == "{" else ("fail", at)


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.MARKER)
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len(self.MARKER) :].strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [self.call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:start].rstrip(), calls

    def call_start(self, text: str) -> int | None:
        return _marker_start(text, self.MARKER)

    def next_call(self, text: str, start: int, after: int | None) -> Step:
        if not text.startswith(self.MARKER, start):
            return "wait", start  # a partial marker, or not one
        body = _skip_space(text, start + len(self.MARKER))
        if body == len(text):
            return "wait", body
        if text[body] == "{":  # one call, not in an array
            return ("object", body) if after is None else ("end", after)
        return array_call(text, body, after)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}
