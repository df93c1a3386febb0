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

from pdserve.bench.stories.grammar import NAMES, TEMPLATES, TOOLS, WORDS

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
def _patterns() -> tuple[re.Pattern[str], ...]:
    return tuple(_compile(t) for t in TEMPLATES)


@cache
def _lowerable() -> frozenset[str]:
    """Words a template may start with, written in lower case (a sentence capitalizes them)."""
    starts = set()
    for template in TEMPLATES:
        head = template.lstrip('"').split(" ", 1)[0].rstrip(",!?.")
        slot = _SLOT.fullmatch(head)
        starts.update(SLOT_WORDS[slot.group(1)] if slot else [head])
    return frozenset(w for w in starts if w[:1].islower())


def canonical(sentence: str) -> str:
    """A sentence as the templates write it: its first word in lower case unless it is a name."""
    sentence = " ".join(sentence.split())
    i = 1 if sentence.startswith('"') else 0
    word = re.match(r"[A-Za-z]+", sentence[i:])
    if word and (word.group(0)[:1].lower() + word.group(0)[1:]) in _lowerable():
        sentence = sentence[:i] + sentence[i].lower() + sentence[i + 1 :]
    return sentence


def accepts(sentence: str) -> bool:
    """Whether the grammar can produce this one sentence (capitalized, as it writes them)."""
    head = sentence.lstrip(' "')
    if not head[:1].isupper():
        return False
    text = canonical(sentence)
    return any(p.fullmatch(text) for p in _patterns())


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


def read(text: str) -> Reading:
    sentences, rest = split_sentences(text)
    reading = Reading(unfinished=rest)
    for sentence in sentences:
        (reading.accepted if accepts(sentence) else reading.rejected).append(sentence)
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
