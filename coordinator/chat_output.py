"""What a chat choice's output says, whichever API a client speaks: its text split into reasoning
(with a reasoning parser), content and tool calls (with tools), whole or as the stream's deltas.
The chat completions, Responses and Messages front ends each render these in their own shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.coordinator.reasoning_parsers import ReasoningPlan
from pdserve.coordinator.tool_call_stream import ToolCallStream
from pdserve.coordinator.tool_choice import ToolPlan
from pdserve.coordinator.tool_parsers import ToolCall


@dataclass(slots=True)
class OutputDelta:
    """One piece of a streamed choice, by kind."""

    reasoning: str = ""
    content: str = ""
    # OpenAI's `tool_calls` delta entries: a call's first carries its index, id, type and name
    # (`tool_call_stream.call_delta`), the next ones more of its arguments.
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(slots=True)
class ChatOutput:
    """A whole choice: reasoning None without a reasoning part, content None when it is all
    calls."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    finish_reason: str


class ChatOutputStream:
    """One streamed choice's text deltas turned into OutputDeltas: the reasoning first, then the
    answer's content and tool calls."""

    def __init__(self, tools: ToolPlan, reasoning: ReasoningPlan | None) -> None:
        self.tools = ToolCallStream(tools) if tools.calls_tools else None
        self.reasoning = reasoning.parser.stream(reasoning) if reasoning is not None else None

    def feed(self, text: str, finished: bool) -> OutputDelta:
        """finished: this is the output's last piece."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.feed(text, finished)
        if self.tools is None:
            return OutputDelta(reasoning, answer)
        delta = self.tools.delta(answer, finished)
        return OutputDelta(reasoning, delta.get("content", ""), delta.get("tool_calls", []))

    def finish_reason(self, reason: str | None) -> str | None:
        """tool_calls for an output that stopped after calling."""
        return reason if self.tools is None else self.tools.finish_reason(reason)


def chat_output(
    text: str, finish_reason: str, tools: ToolPlan, reasoning: ReasoningPlan | None
) -> ChatOutput:
    """A whole choice's output, split."""
    thought, answer = (None, text) if reasoning is None else reasoning.split(text)
    if not tools.calls_tools:
        return ChatOutput(thought, answer, [], finish_reason)
    content, calls = tools.calls(answer)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatOutput(thought, content, calls, finish_reason)
