"""One streamed chat choice of a request with tools: its text deltas turned into the chunks'
`delta`s OpenAI sends. Text that is content streams as content; tool calls stream as `tool_calls`
deltas, each call's index, id and name first, then its arguments: a named function's arguments
as the model writes them, a required or parsed call's once the output has ended (held until a
call's text is whole)."""

from __future__ import annotations

from pdserve.coordinator.tool_choice import ToolPlan, new_call_id
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


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything so far
        self.shown = 0  # of it, shown as content
        self.called = False  # a tool_calls delta went out

    def delta(self, text: str, finished: bool) -> dict:
        """The chunk's delta for this piece of the output (finished: it is the last)."""
        self.text += text
        plan = self.plan
        if plan.mode == "named":
            if not self.called:
                self.called = True
                return {"tool_calls": [call_delta(0, None, plan.function, text)]}
            return {"tool_calls": [call_delta(0, None, args=text)]} if text else {}
        if plan.mode == "required":
            return self._calls_at_end(finished, self.text)
        # auto: content up to where calls may begin, then hold the rest.
        start = plan.parser.call_start(self.text)
        end = len(self.text) if start is None else start
        while end > self.shown and self.text[end - 1].isspace():  # it may lead into a call
            end -= 1
        out: dict = {}
        if end > self.shown:
            out["content"] = self.text[self.shown : end]
            self.shown = end
        if finished:
            content, calls = plan.calls(self.text)
            if calls:
                out["tool_calls"] = [call_delta(i, c) for i, c in enumerate(calls)]
                self.called = True
            elif self.shown < len(self.text):  # not calls after all: the held text is content
                out["content"] = out.get("content", "") + self.text[self.shown :]
                self.shown = len(self.text)
        return out

    def _calls_at_end(self, finished: bool, text: str) -> dict:
        if not finished:
            return {}
        content, calls = self.plan.calls(text)
        if not calls:  # none whole (cut in the first) is nothing; text not an array is content
            return {"content": content} if content else {}
        self.called = True
        return {"tool_calls": [call_delta(i, c) for i, c in enumerate(calls)]}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason
