"""The reasoning parsers on hand-written outputs, whole and streamed a few characters at a time
(markers split across pieces): where the reasoning begins (the prompt's open or closed think
block, the output's own `<think>`), an output cut before `</think>`, thinking turned off, and the
answer's tool calls and content parsed past the reasoning."""

from __future__ import annotations

import json

import pytest

from pdserve.coordinator.chat_output import ChatOutputStream, chat_output
from pdserve.coordinator.reasoning_parsers import PARSERS, ReasoningStream
from pdserve.coordinator.tool_choice import plan_tools

OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
PLAIN_PROMPT = "<|im_start|>assistant\n"
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
THOUGHT = "The cat is Tom's pet.\nTom's cat lives in the barn."
ANSWER = 'The cat is in the barn. {"a": "<b>"}'

GPT_PROMPT = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"

# (parser, prompt, output, reasoning or None, answer)
CASES = [
    # Harmony: the analysis channel is reasoning, the final channel the answer.
    ("openai_gptoss", GPT_PROMPT, f"{A}{THOUGHT}<|end|>{F}{ANSWER}<|return|>", THOUGHT, ANSWER),
    (
        "openai_gptoss",
        GPT_PROMPT,
        f"{A}One.<|end|><|start|>assistant{A}Two.<|end|>{F}{ANSWER}",
        "One.\nTwo.",
        ANSWER,
    ),  # fmt: skip
    ("openai_gptoss", GPT_PROMPT, f"<|channel|>final<|message|>{ANSWER}<|return|>", None, ANSWER),
    ("openai_gptoss", GPT_PROMPT, f"{A}{THOUGHT}", THOUGHT, ""),  # cut while thinking
    ("openai_gptoss", GPT_PROMPT, ANSWER, None, ANSWER),  # no harmony markup at all
    # The template opened the block: reasoning from the output's start.
    ("deepseek_r1", OPEN_PROMPT, f"\n{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", OPEN_PROMPT, f"{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    # The model opens it itself.
    ("qwen3", PLAIN_PROMPT, f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    ("deepseek_r1", PLAIN_PROMPT, f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    # DeepSeek-R1 starts thinking without a marker; Qwen3 without one does not think.
    ("deepseek_r1", PLAIN_PROMPT, f"{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", PLAIN_PROMPT, ANSWER, None, ANSWER),
    # Cut while thinking (max_tokens): all reasoning, no answer.
    ("deepseek_r1", OPEN_PROMPT, THOUGHT + "\n</thi", THOUGHT + "\n</thi", ""),
    ("qwen3", PLAIN_PROMPT, "<think>\n" + THOUGHT, THOUGHT, ""),
    # Thinking turned off (enable_thinking false closes the block in the prompt): all answer,
    # markers the model writes anyway included.
    ("deepseek_r1", CLOSED_PROMPT, ANSWER, None, ANSWER),
    ("qwen3", CLOSED_PROMPT, f"{ANSWER}</think>x", None, f"{ANSWER}</think>x"),
    # An answer that is empty, and reasoning that is empty.
    ("qwen3", OPEN_PROMPT, f"{THOUGHT}</think>", THOUGHT, ""),
    ("qwen3", OPEN_PROMPT, f"\n\n</think>\n\n{ANSWER}", "", ANSWER),
    # A start marker that is not one: "<thin" then other text, in the answer.
    ("qwen3", PLAIN_PROMPT, "<thinking>", None, "<thinking>"),
]


def streamed(plan, text: str, size: int) -> tuple[str | None, str, list[tuple[str, str]]]:
    stream = plan.parser.stream(plan)
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    out = [stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    reasoning = "".join(r for r, _ in out)
    return (reasoning if stream.reasoned else None), "".join(a for _, a in out), out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_parser_splits_an_output_the_same_whole_and_streamed(case, size):
    name, prompt, output, reasoning, answer = case
    plan = PARSERS[name]().plan(prompt)
    assert plan.split(output) == (reasoning, answer)
    got_reasoning, got_answer, pieces = streamed(plan, output, size)
    assert (got_reasoning, got_answer) == (reasoning, answer)
    # Reasoning is given out before the answer, never after it.
    first_answer = next((i for i, (_, a) in enumerate(pieces) if a), len(pieces))
    assert not any(r for r, _ in pieces[first_answer + 1 :])


def test_reasoning_streams_as_it_is_written_not_at_its_end():
    plan = PARSERS["deepseek_r1"]().plan(OPEN_PROMPT)
    _, _, pieces = streamed(plan, f"{THOUGHT}\n</think>\n\n{ANSWER}", 3)
    given = [i for i, (r, _) in enumerate(pieces) if r]
    assert len(given) > len(THOUGHT) // 3 - 4  # nearly every piece gives some out
    # A partial end marker is held until it is known not to be one.
    stream = ReasoningStream(plan)
    assert stream.feed("I see </th", False) == ("I see", "")
    assert stream.feed("e barn", False) == (" </the barn", "")


def test_the_plan_follows_the_prompt():
    r1, qwen3 = PARSERS["deepseek_r1"](), PARSERS["qwen3"]()
    assert r1.plan(OPEN_PROMPT).opens is True and qwen3.plan(OPEN_PROMPT).opens is True
    assert r1.plan(CLOSED_PROMPT).opens is False and qwen3.plan(CLOSED_PROMPT).opens is False
    assert r1.plan(PLAIN_PROMPT).opens is True and qwen3.plan(PLAIN_PROMPT).opens is None
    assert not qwen3.plan(CLOSED_PROMPT).may_reason and qwen3.plan(PLAIN_PROMPT).may_reason


def test_reasoning_tokens_count_up_to_the_end_marker():
    start, end = [7], [9]
    open_plan = PARSERS["qwen3"]().plan(OPEN_PROMPT)
    assert open_plan.reasoning_tokens([1, 2, 9, 3, 4], start, end) == 3
    assert open_plan.reasoning_tokens([1, 2, 3], start, end) == 3  # cut while thinking
    plain = PARSERS["qwen3"]().plan(PLAIN_PROMPT)
    assert plain.reasoning_tokens([7, 1, 9, 3], start, end) == 3
    assert plain.reasoning_tokens([1, 9, 3], start, end) == 0  # did not open: no reasoning
    closed = PARSERS["qwen3"]().plan(CLOSED_PROMPT)
    assert closed.reasoning_tokens([1, 9, 3], start, end) == 0


WHERE_IS = {
    "type": "function",
    "function": {
        "name": "where_is",
        "parameters": {"type": "object", "properties": {"character": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "where_is", "arguments": {"character": "the cat"}}\n</tool_call>'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tool_calls_are_parsed_from_the_answer_only(size):
    """A call written in the reasoning is thought, not called; the answer's call is."""
    tools = plan_tools([WHERE_IS], "auto", None, True, "hermes")
    plan = PARSERS["qwen3"]().plan(OPEN_PROMPT)
    text = f"Not {CALL} yet.\n</think>\n\n{CALL}"
    whole = chat_output(text, "stop", tools, plan)
    assert whole.reasoning == f"Not {CALL} yet."
    assert whole.content is None and whole.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("where_is", {"character": "the cat"})
    ]
    stream = ChatOutputStream(tools, plan)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    deltas = [stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(d.reasoning for d in deltas) == whole.reasoning
    assert "".join(d.content for d in deltas) == ""
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0]["function"]["name"] == "where_is"
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == {"character": "the cat"}
    assert stream.finish_reason("stop") == "tool_calls"


def test_without_a_parser_the_reasoning_is_content():
    tools = plan_tools(None, None, None, False, None)
    text = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    assert chat_output(text, "stop", tools, None).content == text
    assert ChatOutputStream(tools, None).feed(text, True).content == text
