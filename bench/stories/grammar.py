"""The story grammar: word classes, and sentence templates whose slots they fill; a seeded generator
of short stories and chat turns from them. The recognizer (`recognizer.py`) is built from the same
templates, so it accepts exactly the sentences the grammar can produce.

A template is written as its sentence would read in the middle of a text (lower-case first word);
the generator capitalizes the first letter (after an opening quote). Slots: the story's characters
(`{hero}`, `{friend}` with their kinds and pronouns) and its things, places and feelings.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

GIRLS = ("Lily", "Mia", "Anna", "Sara", "Emma", "Lucy", "Zoe", "Amy", "Ella", "Rose", "Kim", "Sue")
BOYS = ("Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Tim", "Finn", "Noah", "Jake", "Bob", "Dan")
NAMES = GIRLS + BOYS

WORDS: dict[str, tuple[str, ...]] = {
    "name": NAMES,
    "kind": (
        "girl",
        "boy",
        "cat",
        "dog",
        "bird",
        "bunny",
        "duck",
        "fox",
        "bear",
        "frog",
        "mouse",
        "puppy",
    ),
    "animal": ("cat", "dog", "bird", "bunny", "duck", "fox", "bear", "frog", "mouse", "puppy"),
    "adj": (
        "little",
        "small",
        "big",
        "kind",
        "brave",
        "happy",
        "shy",
        "curious",
        "friendly",
        "funny",
    ),
    "place": (
        "park",
        "garden",
        "forest",
        "house",
        "school",
        "woods",
        "kitchen",
        "field",
        "yard",
        "meadow",
    ),
    "water": ("river", "pond", "lake", "puddle"),
    "thing": (
        "ball",
        "kite",
        "book",
        "box",
        "flower",
        "apple",
        "hat",
        "toy",
        "cake",
        "shell",
        "stick",
        "boat",
        "drum",
        "cup",
    ),
    "color": ("red", "blue", "green", "yellow", "pink", "purple", "shiny", "soft", "pretty", "new"),
    "glad": ("happy", "glad", "excited", "proud", "surprised"),
    "sad": ("sad", "scared", "worried", "tired", "upset"),
    "activity": ("play", "run", "jump", "sing", "read", "draw", "swim", "dance", "climb", "hide"),
    "pron": ("he", "she"),
    "poss": ("his", "her"),
}
WORDS["feeling"] = WORDS["glad"] + WORDS["sad"]

# Each part of a story: weighted templates. A slot is {class} filled from the story's bindings.
OPEN = (
    (3, "once upon a time, there was a {adj} {kind} named {hero}."),
    (2, "there was once a {adj} {kind} named {hero}."),
    (2, "once upon a time, a {adj} {kind} named {hero} lived near the {place}."),
)
HABIT = (
    (3, "{hero} liked to {activity} in the {place}."),
    (2, "{pron} loved to {activity} with {poss} friends."),
    (2, "every day, {hero} went to the {place} to {activity}."),
    (2, "{hero} had a {color} {thing}."),
    (1, "{pron} liked {poss} {color} {thing} very much."),
)
EVENT = (
    (3, "one day, {hero} went to the {place}."),
    (3, "one day, {hero} found a {color} {thing} in the {place}."),
    (2, "one morning, {hero} saw a {color} {thing} near the {water}."),
    (2, "one sunny day, {hero} wanted to {activity} in the {place}."),
)
GLAD = (
    (3, "{pron} was very {glad}."),
    (2, "{hero} felt {glad}."),
    (1, "{hero} smiled, because {pron} was {glad}."),
)
MEET = (
    (3, "then {hero} met a {adj} {fkind} named {friend}."),
    (2, "soon, a {adj} {fkind} named {friend} came to the {place} too."),
)
TALK = (
    (2, '"hello, {friend}!" said {hero}.'),
    (2, '"can I play with your {thing}?" asked {friend}.'),
    (2, '"yes, you can," said {hero}.'),
    (2, '"let us {activity} together!" said {friend}.'),
    (2, '"I like your {color} {thing}," said {friend}.'),
    (1, '"thank you!" said {hero}.'),
    (1, '"do you want to {activity} with me?" asked {hero}.'),
    (1, '"that is a good idea," said {friend}.'),
)
PROBLEM = (
    (3, "but then the {thing} fell into the {water}."),
    (2, "suddenly, the wind took the {thing} away."),
    (2, "{hero} could not find {poss} {thing}."),
)
SAD = (
    (3, "{pron} was {sad} and started to cry."),
    (2, "{hero} felt very {sad}."),
)
FIX = (
    (3, "{friend} helped {hero} find the {thing}."),
    (2, "{friend} gave {hero} a {color} {thing}."),
    (2, "they looked everywhere and found the {thing} under a tree."),
    (1, "{hero} said sorry, and {friend} smiled."),
)
END = (
    (3, "{hero} and {friend} played together all day."),
    (3, "from that day on, {hero} and {friend} were best friends."),
    (2, "they were very {glad}."),
    (2, "{hero} learned that sharing is good."),
    (2, "the end."),
)

# Chat turns: a user's question and the assistant's answer, sharing their bindings.
CHATS = (
    (
        3,
        "where is the {animal}?",
        (
            "the {animal} is in the {place}.",
            "the {animal} is playing in the {place}.",
            "I think the {animal} is near the {water}.",
        ),
    ),
    (
        2,
        "what does {hero} like to do?",
        ("{hero} likes to {activity}.", "{pron} likes to {activity} in the {place}."),
    ),
    (2, "what color is the {thing}?", ("the {thing} is {color}.",)),
    (2, "how does {hero} feel?", ("{pron} feels {feeling}.", "{hero} is very {feeling} today.")),
    (2, "who is {hero}?", ("{hero} is a {adj} {kind} who lives near the {place}.",)),
    (
        2,
        "what did {hero} find?",
        ("{hero} found a {color} {thing}.", "{pron} found a {color} {thing} in the {place}."),
    ),
    (1, "hello!", ("hello, how can I help you today?",)),
    (1, "can you tell me a story?", ()),  # answered by a short story
)
# Asked for JSON, the assistant answers with one object about the character (not a sentence).
JSON_QUESTION = "describe {hero} in JSON."
# Where-questions the assistant answers with the tool `where_is` when it is offered (below), and
# the sentence it then writes from the tool's result.
WHERE_QUESTIONS = ("where is the {animal}?", "where is {hero}?")
WHERE_ANSWERS = ("the {animal} is in the {place}.", "{hero} is in the {place}.")
QUESTIONS = tuple(q for _, q, _ in CHATS) + (JSON_QUESTION,) + WHERE_QUESTIONS
ANSWERS = tuple(a for _, _, answers in CHATS for a in answers) + WHERE_ANSWERS
STORY_PARTS = (OPEN, HABIT, EVENT, GLAD, MEET, TALK, PROBLEM, SAD, FIX, END)
TEMPLATES: tuple[str, ...] = tuple(
    dict.fromkeys(t for part in STORY_PARTS for _, t in part)
) + tuple(dict.fromkeys(QUESTIONS + ANSWERS))


@dataclass(slots=True)
class Cast:
    """What one story (or chat turn) is about: every slot's value."""

    hero: str
    kind: str
    friend: str
    fkind: str
    place: str
    water: str
    thing: str
    color: str
    activity: str
    adj: str
    glad: str
    sad: str
    animal: str

    @property
    def pron(self) -> str:
        return "she" if self.hero in GIRLS else "he"

    @property
    def poss(self) -> str:
        return "her" if self.hero in GIRLS else "his"

    def slot(self, name: str) -> str:
        if name == "feeling":
            return self.glad
        return getattr(self, name)


def cast(rng: random.Random) -> Cast:
    hero, friend = rng.sample(NAMES, 2)
    kinds = WORDS["kind"]
    # Children are girls or boys by their names; animals may have any name.
    kind = rng.choice(["girl" if hero in GIRLS else "boy", *WORDS["animal"][:4]])
    fkind = rng.choice(["girl" if friend in GIRLS else "boy", *kinds[2:]])
    return Cast(
        hero=hero,
        kind=kind,
        friend=friend,
        fkind=fkind,
        place=rng.choice(WORDS["place"]),
        water=rng.choice(WORDS["water"]),
        thing=rng.choice(WORDS["thing"]),
        color=rng.choice(WORDS["color"]),
        activity=rng.choice(WORDS["activity"]),
        adj=rng.choice(WORDS["adj"]),
        glad=rng.choice(WORDS["glad"]),
        sad=rng.choice(WORDS["sad"]),
        animal=rng.choice(WORDS["animal"]),
    )


def capitalize(sentence: str) -> str:
    """The first letter in upper case (after an opening quote)."""
    i = 1 if sentence.startswith('"') else 0
    return sentence[:i] + sentence[i].upper() + sentence[i + 1 :]


def fill(template: str, who: Cast) -> str:
    out, rest = [], template
    while "{" in rest:
        before, _, rest = rest.partition("{")
        name, _, rest = rest.partition("}")
        out += [before, who.slot(name)]
    out.append(rest)
    return capitalize("".join(out))


def _pick(rng: random.Random, part: tuple[tuple[int, str], ...]) -> str:
    weights = [w for w, _ in part]
    return rng.choices([t for _, t in part], weights)[0]


def story(rng: random.Random, who: Cast | None = None) -> str:
    """One story: an opening, a habit or two, an event and how it felt, maybe a friend met and a
    talk, maybe a problem solved, an ending."""
    who = who or cast(rng)
    parts = [OPEN, HABIT]
    if rng.random() < 0.4:
        parts.append(HABIT)
    parts += [EVENT, GLAD, MEET]
    parts += [TALK] * rng.randint(1, 4)
    if rng.random() < 0.6:
        parts += [PROBLEM, SAD, FIX]
    parts += [END] * rng.randint(1, 2)
    sentences: list[str] = []
    for part in parts:
        sentence = fill(_pick(rng, part), who)
        if sentence not in sentences:  # a story does not say the same thing twice
            sentences.append(sentence)
    return " ".join(sentences)


def short_story(rng: random.Random, who: Cast | None = None) -> str:
    """Three sentences: how the assistant answers a request for a story."""
    who = who or cast(rng)
    return " ".join(fill(_pick(rng, part), who) for part in (OPEN, HABIT, END))


def chat_turn(rng: random.Random) -> tuple[str, str]:
    """A user's question and the assistant's answer (one or two sentences)."""
    weights = [w for w, _, _ in CHATS]
    _, question, answers = rng.choices(CHATS, weights)[0]
    who = cast(rng)
    if not answers:
        return fill(question, who), short_story(rng)
    answer = fill(rng.choice(answers), who)
    if rng.random() < 0.3:  # a second sentence about the same character
        answer += " " + fill(_pick(rng, HABIT), who)
    return fill(question, who), answer


def json_answer(who: Cast) -> str:
    """The assistant's answer to JSON_QUESTION."""
    return json.dumps({"name": who.hero, "kind": who.kind, "home": who.place})


# The tool the assistant learned to call, as a request offers it (OpenAI's function format), and
# the questions it calls it for: where an animal ("the cat") or a named character is.
WHERE_IS = {
    "type": "function",
    "function": {
        "name": "where_is",
        "description": "where a character of the story world is",
        "parameters": {
            "type": "object",
            "properties": {"character": {"type": "string", "description": "an animal or a name"}},
            "required": ["character"],
        },
    },
}
TOOLS = (WHERE_IS,)


def tool_turn(rng: random.Random, who: Cast | None = None) -> list[dict]:
    """A conversation that calls `where_is`: the user's question, the assistant's call, the tool's
    answer (a JSON object) and the assistant's sentence built from it."""
    who = who or cast(rng)
    which = rng.randrange(len(WHERE_QUESTIONS))
    question, answer = WHERE_QUESTIONS[which], WHERE_ANSWERS[which]
    character = who.animal if "{animal}" in question else who.hero
    call = {
        "id": f"call_{rng.randrange(16**8):08x}",
        "type": "function",
        "function": {"name": "where_is", "arguments": {"character": character}},
    }
    return [
        {"role": "user", "content": fill(question, who)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"place": who.place})},
        {"role": "assistant", "content": fill(answer, who)},
    ]


def conversation(rng: random.Random) -> tuple[list[dict], tuple[dict, ...]]:
    """One chat document: its messages and the tools the request offered (the tool, for half).

    With the tool offered, a question about where someone is gets a call and any other question
    a plain answer; without it, the same where-questions get sentences: so the assistant learns
    when to call. Asked for JSON, it writes JSON."""
    draw = rng.random()
    if draw < 0.35:
        return tool_turn(rng), TOOLS
    who = cast(rng)
    if draw < 0.45:
        question, answer = fill(JSON_QUESTION, who), json_answer(who)
    elif draw < 0.7:  # where-questions, no tool: answered from the story world
        which = rng.randrange(len(WHERE_QUESTIONS))
        question, answer = fill(WHERE_QUESTIONS[which], who), fill(WHERE_ANSWERS[which], who)
    else:
        while True:
            question, answer = chat_turn(rng)
            if not question.startswith("Where is"):
                break
    tools = TOOLS if 0.7 <= draw < 0.85 else ()
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ], tools


# --- reasoning -----------------------------------------------------------------------------------
# With thinking on, the assistant first states (between <think> and </think>) the facts of the
# story world it will use, in one or two templated sentences, then answers from them: each
# question's reasoning, and the answers that follow from it (None: a short story about `hero`).
THOUGHTS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "where is the {animal}?": (
        "the {animal} is {hero}'s pet. {hero}'s {animal} lives in the {place}.",
        ("the {animal} is in the {place}.", "the {animal} is playing in the {place}."),
    ),
    "where is {hero}?": (
        "every day, {hero} went to the {place} to {activity}.",
        ("{hero} is in the {place}.",),
    ),
    "what does {hero} like to do?": (
        "{hero} is a {adj} {kind}. {hero} liked to {activity} in the {place}.",
        ("{hero} likes to {activity}.", "{pron} likes to {activity} in the {place}."),
    ),
    "what color is the {thing}?": ("{hero} had a {color} {thing}.", ("the {thing} is {color}.",)),
    "how does {hero} feel?": (
        "one day, {hero} found a {color} {thing} in the {place}.",
        ("{pron} feels {feeling}.", "{hero} is very {feeling} today."),
    ),
    "who is {hero}?": (
        "{hero} is a {adj} {kind}. {hero} lives near the {place}.",
        ("{hero} is a {adj} {kind} who lives near the {place}.",),
    ),
    "what did {hero} find?": (
        "one day, {hero} found a {color} {thing} in the {place}.",
        ("{hero} found a {color} {thing}.", "{pron} found a {color} {thing} in the {place}."),
    ),
    "hello!": ("the user says hello.", ("hello, how can I help you today?",)),
    "can you tell me a story?": ("I will tell a story about {hero}.", None),
    JSON_QUESTION: ("{hero} is a {adj} {kind}. {hero} lives near the {place}.", ()),
}
# Before a call: the tool it needs; after the tool's result: what the result says.
CALL_THOUGHTS = ("I need where_is for the {animal}.", "I need where_is for {hero}.")
RESULT_THOUGHTS = (
    "the tool says the {animal} is in the {place}.",
    "the tool says {hero} is in the {place}.",
)
REASONS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [s.strip() + "." for r, _ in THOUGHTS.values() for s in r.split(".") if s.strip()]
        + list(CALL_THOUGHTS + RESULT_THOUGHTS)
    )
)
THINKING_SHARE = 0.5  # of conversations, in the corpus with thinking


def fill_all(text: str, who: Cast) -> str:
    """Sentences filled and each capitalized."""
    return " ".join(fill(s.strip() + ".", who) for s in text.split(".") if s.strip())


def reasoned_conversation(
    rng: random.Random,
) -> tuple[list[dict], tuple[dict, ...], str | None]:
    """One chat document as `conversation` draws them, and for THINKING_SHARE of them the
    reasoning its last assistant turn opens with (None: thinking off). A tool conversation ends,
    for half, at the call (so its last turn is the call, with or without reasoning)."""
    think = rng.random() < THINKING_SHARE
    draw = rng.random()
    who = cast(rng)
    if draw < 0.35:
        messages = tool_turn(rng, who)
        which = 0 if messages[0]["content"].startswith("Where is the ") else 1
        if rng.random() < 0.5:
            return messages[:2], TOOLS, fill(CALL_THOUGHTS[which], who) if think else None
        return messages, TOOLS, fill(RESULT_THOUGHTS[which], who) if think else None
    if draw < 0.45:
        question = JSON_QUESTION
    elif draw < 0.7:  # where-questions, no tool: answered from the story world
        question = WHERE_QUESTIONS[rng.randrange(len(WHERE_QUESTIONS))]
    else:
        weights = [w for w, q, _ in CHATS if not q.startswith("where is")]
        chats = [c for c in CHATS if not c[1].startswith("where is")]
        question = rng.choices(chats, weights)[0][1]
    tools = TOOLS if 0.7 <= draw < 0.85 else ()
    reasoning, answers = THOUGHTS[question]
    if question == JSON_QUESTION:
        answer = json_answer(who)
    elif answers is None:
        answer = short_story(rng, who)
    elif think:
        answer = fill(rng.choice(answers), who)
    else:  # as before: any of the question's answers, maybe a second sentence
        answer = fill(rng.choice(_answers(question)), who)
        if rng.random() < 0.3:
            answer += " " + fill(_pick(rng, HABIT), who)
    messages = [{"role": "user", "content": fill(question, who)}]
    messages.append({"role": "assistant", "content": answer})
    return messages, tools, fill_all(reasoning, who) if think else None


def _answers(question: str) -> tuple[str, ...]:
    """The answers `conversation` draws from for a question (with thinking off)."""
    if question in WHERE_QUESTIONS:
        return (WHERE_ANSWERS[WHERE_QUESTIONS.index(question)],)
    return next(a for _, q, a in CHATS if q == question)
