"""Reasoning in a model's output, as vLLM's `--reasoning-parser` names the formats: a parser
splits an output into its reasoning and its answer, whole or streamed a piece at a time, and says
which text ends the reasoning (a request's constraint and tool calls apply to the answer only).

- `deepseek_r1`: `<think>` reasoning `</think>` answer, where the opening `<think>` may be in the
  prompt (the chat template's) or missing altogether (DeepSeek-R1 starts thinking at once): the
  output is reasoning from its start.
- `qwen3`: the same markers; the output is reasoning from its start when the prompt leaves a
  `<think>` open (Qwen3.5's and the 2507 thinking models' templates), or when the output itself
  opens with `<think>` (Qwen3's); otherwise it is all answer.

- `openai_gptoss`: gpt-oss's harmony channels, read from the text with its special tokens kept:
  `<|channel|>analysis<|message|>` reasoning `<|end|>`, then `<|start|>assistant<|channel|>final
  <|message|>` answer (`<|return|>`). Several analysis messages join with a newline; text in the
  commentary channel (a preamble) is answer.

For `<think>` formats, a prompt that ends with a closed think block (`enable_thinking: false`
renders `<think>\\n\\n</think>\\n\\n`) means no reasoning: the output is all answer. An output that
ends while still reasoning (no end marker: cut by max_tokens) is all reasoning. The reasoning is
returned without its surrounding whitespace, the answer without its leading whitespace.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


class ReasoningParser:
    """One format: where an output's reasoning begins and ends (`end`: the text after which the
    answer, and so its constraint, begins)."""

    name: str
    start = START
    end = END
    # Reasoning from the output's start when the prompt says nothing (no open or closed block).
    reasons_by_default: bool
    # The output is read as text with the model's special tokens (harmony's markers are).
    keeps_special_tokens = False

    def stream(self, plan: ReasoningPlan) -> ReasoningStream | HarmonyStream:
        return ReasoningStream(plan)

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


class GptOssParser(ReasoningParser):
    name = "openai_gptoss"
    start = "<|channel|>analysis<|message|>"
    end = "<|channel|>final<|message|>"
    reasons_by_default = False
    keeps_special_tokens = True

    def plan(self, prompt_text: str) -> ReasoningPlan:
        return ReasoningPlan(self, opens=None)  # it reasons when it opens the analysis channel

    def stream(self, plan: ReasoningPlan) -> HarmonyStream:
        return HarmonyStream()


PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, GptOssParser)
}


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
        stream = self.parser.stream(self)
        reasoning, answer = stream.feed(text, finished=True)
        return (reasoning if stream.reasoned else None), answer

    def reasoning_tokens(
        self, output_ids: list[int], start_ids: list[int], end_ids: list[int]
    ) -> int:
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


# Harmony's markers: a message's header is `<|start|>ROLE<|channel|>NAME<|message|>` (the first
# one's `<|start|>assistant` is the prompt's), its body ends at `<|end|>`, `<|return|>` (the
# output's end) or `<|call|>`.
CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HARMONY_MARKERS = (CHANNEL, MESSAGE, "<|start|>", *BODY_ENDS)


class HarmonyStream:
    """A harmony output's text deltas split into (reasoning delta, answer delta): the analysis
    channel is reasoning, every other channel answer. Text that may begin a marker is held."""

    def __init__(self) -> None:
        self.held = ""
        self.channel: str | None = None  # the message being read (None: between messages)
        self.reasoned = False
        self.answered = False
        self.first_piece = True  # the next body text is its message's first

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.held += text
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            if self.channel is None:
                if not self._header(finished):
                    break
                continue
            end, at = _first_of(self.held, BODY_ENDS)
            if end is None:
                keep = 0 if finished else max(_partial_suffix(self.held, m) for m in BODY_ENDS)
                body, self.held = (
                    self.held[: len(self.held) - keep],
                    self.held[len(self.held) - keep :],
                )
            else:
                body, self.held = self.held[:at], self.held[at + len(end) :]
            self._body(body, reasoning, answer)
            if end is None:
                break
            self.channel = None
        return "".join(reasoning), "".join(answer)

    def _header(self, finished: bool) -> bool:
        """Reads a message's header: False while it is incomplete."""
        at = self.held.find(MESSAGE)
        if at < 0:
            unmarked = not self.held.startswith("<|") and not "<|".startswith(self.held)
            if finished or unmarked:  # text outside any message: answer
                self.channel, self.first_piece = "final", True
                return True
            return False
        header, self.held = self.held[:at], self.held[at + len(MESSAGE) :]
        name = header.rpartition(CHANNEL)[2].split()[0] if CHANNEL in header else "final"
        self.channel = name
        self.first_piece = True
        return True

    def _body(self, body: str, reasoning: list[str], answer: list[str]) -> None:
        if not body:
            return
        if self.channel == "analysis":
            if self.first_piece and self.reasoned:
                reasoning.append("\n")  # between two analysis messages
            self.reasoned = True
            reasoning.append(body)
        else:
            if self.first_piece and self.answered:
                answer.append("\n")
            self.answered = True
            answer.append(body)
        self.first_piece = False


def _first_of(text: str, markers: tuple[str, ...]) -> tuple[str | None, int]:
    """The marker that occurs first in text, and where."""
    found = [(text.find(m), m) for m in markers if m in text]
    if not found:
        return None, -1
    at, marker = min(found)
    return marker, at
