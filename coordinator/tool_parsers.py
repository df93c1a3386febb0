"""Tool calls in a model's own output format, as vLLM's `--tool-call-parser` names them: each
parser splits an output into its text and its calls, and says where in a stream the calls may
begin (the text before that streams as content; the rest is held until the output ends).

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


class ToolParser:
    """Splits an output into (its text, its tool calls); text that looks like a call but does
    not parse stays text."""

    name: str

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
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].rstrip(), calls

    def call_start(self, text: str) -> int | None:
        return _marker_start(text, self.OPEN)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

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
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return "", calls

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return None
        if stripped.startswith("{") or self.TAG.startswith(stripped[: len(self.TAG)]):
            return len(text) - len(stripped)
        return None


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
        calls = [_call(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:start].rstrip(), calls

    def call_start(self, text: str) -> int | None:
        return _marker_start(text, self.MARKER)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}
