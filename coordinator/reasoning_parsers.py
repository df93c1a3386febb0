"""Reasoning in a model's output, as vLLM's `--reasoning-parser` names the formats: a parser
splits an output into its reasoning and its answer, whole or streamed a piece at a time, and says
which text ends the reasoning (a request's constraint and tool calls apply to the answer only).

- `deepseek_r1`: `<think>` reasoning `</think>` answer, where the opening `<think>` may be in the
  prompt (the chat template's) or missing altogether (DeepSeek-R1 starts thinking at once): the
  output is reasoning from its start.
- `qwen3`: the same markers; the output is reasoning from its start when the prompt leaves a
  `<think>` open (Qwen3.5's and the 2507 thinking models' templates), or when the output itself
  opens with `<think>` (Qwen3's); otherwise it is all answer.

For both, a prompt that ends with a closed think block (`enable_thinking: false` renders
`<think>\\n\\n</think>\\n\\n`) means no reasoning: the output is all answer. An output that ends
while still reasoning (no `</think>`: cut by max_tokens) is all reasoning. The reasoning is
returned without its surrounding whitespace, the answer without its leading whitespace.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


class ReasoningParser:
    """One format: where an output's reasoning begins and ends."""

    name: str
    start = START
    end = END
    # Reasoning from the output's start when the prompt says nothing (no open or closed block).
    reasons_by_default: bool

    def plan(self, prompt_text: str) -> ReasoningPlan:
        """What a request whose prompt (as rendered text) is prompt_text does."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.end):
            return ReasoningPlan(self, opens=False)
        if tail.endswith(self.start):
            return ReasoningPlan(self, opens=True)
        return ReasoningPlan(self, opens=True if self.reasons_by_default else None)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    reasons_by_default = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    reasons_by_default = False


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """One request's reasoning: opens True (its output starts in reasoning), False (it has none)
    or None (it reasons when the output opens with the start marker)."""

    parser: ReasoningParser
    opens: bool | None

    @property
    def may_reason(self) -> bool:
        """Whether the output may open with reasoning (so a constraint waits for its end)."""
        return self.opens is not False

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output as (its reasoning, None if it has none; its answer)."""
        stream = ReasoningStream(self)
        reasoning, answer = stream.feed(text, finished=True)
        return (reasoning if stream.reasoned else None), answer

    def reasoning_tokens(self, output_ids: list[int], start_ids: list[int], end_ids: list[int]
                         ) -> int:  # fmt: skip
        """How many of the output's tokens are reasoning: up to its end marker's (included)."""
        if self.opens is False or not end_ids:
            return 0
        if self.opens is None and output_ids[: len(start_ids)] != start_ids:
            return 0
        n = len(end_ids)
        for i in range(len(output_ids) - n + 1):
            if output_ids[i : i + n] == end_ids:
                return i + n
        return len(output_ids)


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of text may begin the marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """One output's text deltas split into (reasoning delta, answer delta). Text that may be the
    start of a marker, or whitespace that may turn out to surround the reasoning, is held until
    the next piece tells."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.plan = plan
        self.parser = plan.parser
        # opening: deciding whether the output opens with the start marker; reasoning; answer
        self.state = "answer" if plan.opens is False else "opening"
        self.reasoned = False  # the output had a reasoning part
        self.held = ""  # text received and not yet given out
        self.trim = False  # the whitespace before the next text is dropped (after a marker)

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.held += text
        reasoning = answer = ""
        if self.state == "opening":
            self._open(finished)
        if self.state == "reasoning":
            reasoning = self._reason(finished)
        if self.state == "answer":
            answer = self._answer(finished)
        return reasoning, answer

    def _open(self, finished: bool) -> None:
        stripped = self.held.lstrip()
        start = self.parser.start
        if stripped.startswith(start):
            self.held = stripped[len(start) :]
            self._enter_reasoning()
        elif start.startswith(stripped) and not finished:
            return  # (all whitespace, or a partial start marker): wait
        elif self.plan.opens:
            self._enter_reasoning()
        else:
            self.state = "answer"

    def _enter_reasoning(self) -> None:
        self.state = "reasoning"
        self.reasoned = True
        self.trim = True

    def _trimmed(self) -> bool:
        """Drops the whitespace after a marker; False while there is nothing else yet."""
        if self.trim:
            self.held = self.held.lstrip()
            if not self.held:
                return False
            self.trim = False
        return True

    def _reason(self, finished: bool) -> str:
        end = self.parser.end
        if not self._trimmed():
            return ""
        at = self.held.find(end)
        if at >= 0:
            out = self.held[:at].rstrip()
            self.held = self.held[at + len(end) :]
            self.state = "answer"
            self.trim = True
            return out
        if finished:
            out, self.held = self.held.rstrip(), ""
            return out
        keep = _partial_suffix(self.held, end)
        body = self.held[: len(self.held) - keep]
        kept_space = len(body) - len(body.rstrip())  # may end the reasoning: held
        cut = len(body) - kept_space
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def _answer(self, finished: bool) -> str:
        if not self._trimmed():
            return ""
        out, self.held = self.held, ""
        return out
