"""One streamed chat choice of a request with tools: its text deltas turned into the chunks'
`delta`s OpenAI sends. Text that is content streams as content; each tool call streams as
`tool_calls` deltas as the model writes it: its index, id and name once the name is whole, then
its arguments as they are written (as vLLM streams them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.coordinator.call_scanner import CallScanner
from pdserve.coordinator.tool_choice import REQUIRED_CALLS, ToolPlan, new_call_id
from pdserve.coordinator.tool_parsers import ToolCall


def call_delta(index: int, call: ToolCall | None, name: str | None = None, args: str = "") -> dict:
    """A `tool_calls` entry of a delta: the first of a call carries its id, type and name."""
    if call is None and name is None:
        return {"index": index, "function": {"arguments": args}}
    return {
        "index": index,
        "id": new_call_id(),
        "type": "function",
        "function": {
            "name": name or call.name,
            "arguments": args or (call.arguments if call else ""),
        },
    }


@dataclass(slots=True)
class _StreamedCall:
    index: int
    scanner: CallScanner
    announced: bool = False  # its id and name went out
    sent: int = 0  # how far into the text its arguments went out as written

    @property
    def whole(self) -> bool:
        return self.scanner.end is not None


class ToolCallStream:
    """The deltas of one choice: content until its calls begin, then each call as it is read."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.format = plan.parser if plan.mode == "auto" else REQUIRED_CALLS
        self.text = ""  # everything so far
        self.shown = 0  # of it, shown as content
        self.called = False  # a tool_calls delta went out
        self.start: int | None = None  # where the calls begin, once that is certain
        self.calls: list[_StreamedCall] = []
        self.after: int | None = None  # the end of the last whole call's object
        self.done = False  # past the last call, or at text that is not a call
        self.rest: int | None = None  # where the text stopped being calls, when done

    def delta(self, text: str, finished: bool) -> dict:
        """The chunk's delta for this piece of the output (finished: it is the last)."""
        self.text += text
        plan = self.plan
        if plan.mode == "named":
            if not self.called:
                self.called = True
                return {"tool_calls": [call_delta(0, None, plan.function, text)]}
            return {"tool_calls": [call_delta(0, None, args=text)]} if text else {}
        out: dict = {}
        if self.start is None:
            self._content(out)
        entries: list[dict] = []
        if self.start is not None:
            self._read_calls(entries)
        if finished:
            return self._end(out, entries)
        if entries:
            out["tool_calls"] = entries
            self.called = True
        return out

    def _content(self, out: dict) -> None:
        """Content up to where calls may begin; there, the calls begin once that is certain."""
        start = self.format.call_start(self.text)
        end = len(self.text) if start is None else start
        while end > self.shown and self.text[end - 1].isspace():  # it may lead into a call
            end -= 1
        if end > self.shown:
            out["content"] = self.text[self.shown : end]
            self.shown = end
        if start is not None and self.format.next_call(self.text, start, None)[0] != "wait":
            self.start = start

    def _read_calls(self, entries: list[dict]) -> None:
        """Reads on through the calls, adding to entries what of them may go out."""
        while True:
            call = self.calls[-1] if self.calls else None
            if call is not None and not call.whole:
                shown = self.plan.parallel or call.index == 0  # parallel false: the first only
                call.scanner.feed(self.text)
                if shown:
                    self._stream(call, entries)
                if not call.whole:
                    return
                self._close(call, entries, shown)
                continue
            if self.done:
                return
            step, at = self.format.next_call(self.text, self.start, self.after)
            if step == "object":
                self.calls.append(
                    _StreamedCall(len(self.calls), CallScanner(at, self.format.args_key))
                )
            elif step == "wait":
                return
            else:  # "end" or "fail"
                self.done, self.rest = True, at

    def _stream(self, call: _StreamedCall, entries: list[dict]) -> None:
        scanner = call.scanner
        if not call.announced and scanner.name is not None:
            call.announced = True
            entries.append(call_delta(call.index, None, scanner.name))
        written = scanner.args_written
        if call.announced and written is not None and written > max(call.sent, scanner.args_start):
            _add_args(entries, call.index, self.text[max(call.sent, scanner.args_start) : written])
            call.sent = written

    def _close(self, call: _StreamedCall, entries: list[dict], shown: bool) -> None:
        scanner = call.scanner
        try:
            parsed = self.format.call(json.loads(self.text[scanner.start : scanner.end]))
        except ValueError:
            parsed = None
        if parsed is None:
            self.done, self.rest = True, scanner.start
            return
        self.after = scanner.end
        if not shown:
            return
        if not call.announced:
            call.announced = True
            entries.append(call_delta(call.index, parsed))
        elif scanner.args_start is None:  # arguments not streamed as written: now, whole
            _add_args(entries, call.index, parsed.arguments)

    def _end(self, out: dict, entries: list[dict]) -> dict:
        content, calls = self.plan.calls(self.text)
        if not self.plan.parallel:  # a required array is one call by its grammar already
            calls = calls[:1]
        if not self.called:
            # Nothing went out as a call: the whole output's parse decides, as unstreamed.
            if calls:
                out["tool_calls"] = [call_delta(i, c) for i, c in enumerate(calls)]
                self.called = True
            elif content is not None and self.shown < len(self.text):
                out["content"] = out.get("content", "") + self.text[self.shown :]
                self.shown = len(self.text)
            return out
        # Calls went out and cannot be taken back: they stand, a call cut short as far as it was
        # streamed (a call first seen in this last piece goes out only whole). If the output
        # then fails to parse (the unstreamed response makes all of it content), the text from
        # the first object that is not a call, or from where the text stops being calls, is
        # content, so nothing is lost; an announced call whose own object fails to parse keeps
        # what it streamed, and its object's text is content too. A cut call is not content.
        open_call = next((c for c in self.calls if c.announced and not c.whole), None)
        if open_call is not None and any(
            e["index"] == open_call.index and "id" in e for e in entries
        ):
            entries = [e for e in entries if e["index"] != open_call.index]
            open_call.announced = False
            open_call = None
        streamed = sum(c.announced for c in self.calls)
        if calls and len(calls) > streamed and open_call is None:  # whole calls the scan missed
            entries += [call_delta(i, c) for i, c in enumerate(calls) if i >= streamed]
        elif not calls and self.rest is not None and self.text[self.rest :].strip():
            out["content"] = out.get("content", "") + self.text[self.rest :]
        if entries:
            out["tool_calls"] = entries
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason


def _add_args(entries: list[dict], index: int, args: str) -> None:
    """Arguments for the call at index, joined to this delta's last entry when it is that call's."""
    if entries and entries[-1]["index"] == index:
        entries[-1]["function"]["arguments"] += args
    else:
        entries.append(call_delta(index, None, args=args))
