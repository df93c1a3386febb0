"""The grammar's recognizer: splits a text into sentences and says which of them the story grammar
could have produced. Built from the grammar's own templates (each compiled to a regular
expression whose slots match their word classes), so generator and acceptor cannot drift apart.
It judges sentences one by one: whether a story's characters stay consistent is not its concern.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache

from pdserve.bench.stories.grammar import NAMES, REASONS, TEMPLATES, TOOLS, WORDS

SLOT_WORDS = {**WORDS, "hero": NAMES, "friend": NAMES, "fkind": WORDS["kind"]}
_SLOT = re.compile(r"\{(\w+)\}")


def _compile(template: str) -> re.Pattern[str]:
    pattern, last = [], 0
    for match in _SLOT.finditer(template):
        pattern.append(re.escape(template[last : match.start()]))
        words = sorted(SLOT_WORDS[match.group(1)], key=len, reverse=True)
        pattern.append("(?:" + "|".join(map(re.escape, words)) + ")")
        last = match.end()
    pattern.append(re.escape(template[last:]))
    return re.compile("".join(pattern))


@cache
def _patterns(templates: tuple[str, ...] = TEMPLATES) -> tuple[re.Pattern[str], ...]:
    return tuple(_compile(t) for t in templates)


@cache
def _lowerable(templates: tuple[str, ...] = TEMPLATES) -> frozenset[str]:
    """Words a template may start with, written in lower case (a sentence capitalizes them)."""
    starts = set()
    for template in templates:
        head = template.lstrip('"').split(" ", 1)[0].rstrip(",!?.")
        slot = _SLOT.fullmatch(head)
        starts.update(SLOT_WORDS[slot.group(1)] if slot else [head])
    return frozenset(w for w in starts if w[:1].islower())


def canonical(sentence: str, templates: tuple[str, ...] = TEMPLATES) -> str:
    """A sentence as the templates write it: its first word in lower case unless it is a name."""
    sentence = " ".join(sentence.split())
    i = 1 if sentence.startswith('"') else 0
    word = re.match(r"[A-Za-z]+", sentence[i:])
    if word and (word.group(0)[:1].lower() + word.group(0)[1:]) in _lowerable(templates):
        sentence = sentence[:i] + sentence[i].lower() + sentence[i + 1 :]
    return sentence


def accepts(sentence: str, templates: tuple[str, ...] = TEMPLATES) -> bool:
    """Whether the grammar can produce this one sentence (capitalized, as it writes them), from
    its story and chat templates (or others: REASONS)."""
    head = sentence.lstrip(' "')
    if not head[:1].isupper():
        return False
    text = canonical(sentence, templates)
    return any(p.fullmatch(text) for p in _patterns(templates))


def split_sentences(text: str) -> tuple[list[str], str]:
    """The complete sentences of a text (ending in . ! or ? outside quotes, a closing quote
    included) and what is left after the last of them (an unfinished sentence)."""
    sentences: list[str] = []
    start, quoted = 0, False
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif ch in ".!?" and not quoted:
            sentence = text[start : i + 1].strip()
            if sentence:
                sentences.append(sentence)
            start = i + 1
    return sentences, text[start:].strip()


@dataclass(slots=True)
class Reading:
    """How much of a text the grammar accepts."""

    accepted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    unfinished: str = ""

    @property
    def num_sentences(self) -> int:
        return len(self.accepted) + len(self.rejected)

    @property
    def share(self) -> float:
        """Accepted complete sentences, as a share of all complete ones (1.0 when none)."""
        return len(self.accepted) / self.num_sentences if self.num_sentences else 1.0


def read(text: str, templates: tuple[str, ...] = TEMPLATES) -> Reading:
    sentences, rest = split_sentences(text)
    reading = Reading(unfinished=rest)
    for sentence in sentences:
        (reading.accepted if accepts(sentence, templates) else reading.rejected).append(sentence)
    return reading


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_CHARACTERS = frozenset(WORDS["animal"]) | frozenset(NAMES)


def tool_calls(text: str) -> list[object]:
    """The bodies of a text's `<tool_call>` blocks, parsed as JSON (None where one does not)."""
    calls = []
    for body in _CALL.findall(text):
        try:
            calls.append(json.loads(body))
        except ValueError:
            calls.append(None)
    return calls


def accepts_call(call: object) -> bool:
    """Whether a tool call is one the grammar makes: a tool it offers, with exactly its parameters,
    naming a character of the story world ({"name": "where_is", "arguments": {"character": "cat"}})."""
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        return False
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == call["name"]), None)
    args = call["arguments"]
    if tool is None or not isinstance(args, dict):
        return False
    return set(args) == set(tool["parameters"]["properties"]) and all(
        v in _CHARACTERS for v in args.values()
    )


def accepts_json_answer(text: str) -> bool:
    """Whether a text is the JSON answer the grammar writes about a character
    ({"name": "Mia", "kind": "bird", "home": "meadow"})."""
    try:
        answer = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(answer, dict)
        and list(answer) == ["name", "kind", "home"]
        and answer["name"] in NAMES
        and answer["kind"] in WORDS["kind"]
        and answer["home"] in WORDS["place"]
    )


def accepts_answer(text: str) -> bool:
    """Whether an assistant's answer is one the grammar gives: tool calls it makes, its JSON
    answer, or one or more whole sentences it writes."""
    text = text.strip()
    if "<tool_call>" in text:
        calls = tool_calls(text)
        return bool(calls) and all(map(accepts_call, calls))
    if text.startswith("{"):
        return accepts_json_answer(text)
    r = read(text)
    return r.num_sentences > 0 and not r.rejected and not r.unfinished


THINK, END_THINK = "<think>", "</think>"


@dataclass(slots=True)
class Thinking:
    """A reply written with thinking on, read: its reasoning (what precedes </think>, sentences
    of REASONS) and its answer (what follows)."""

    reasoning: Reading
    answer: str
    closed: bool  # the reasoning ended with </think>, and no second <think> opened in it

    @property
    def accepted(self) -> bool:
        """Reasoning the grammar writes, closed, then an answer it gives."""
        r = self.reasoning
        return (
            self.closed
            and r.num_sentences > 0
            and not r.rejected
            and not r.unfinished
            and accepts_answer(self.answer)
        )


def read_thinking(text: str) -> Thinking:
    """What the model wrote after the generation prompt with thinking on (which opened the block
    with <think>; a text that opens with it again is read the same)."""
    body = text.removeprefix(THINK)
    reasoning, end, answer = body.partition(END_THINK)
    return Thinking(
        reasoning=read(reasoning, REASONS),
        answer=answer.strip(),
        closed=bool(end) and THINK not in reasoning,
    )
