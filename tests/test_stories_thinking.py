"""pdserve-stories thinks when asked: with `enable_thinking` true its chat template opens a
<think> block and the model, greedy, states facts of its story world the grammar's reasoning
templates write, closes the block with </think> and answers as the grammar answers (a sentence,
a tool call, JSON); with thinking off (the default) the block is closed empty in the prompt and it
answers as before, with no </think> of its own."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.stories import grammar
from pdserve.bench.stories.recognizer import (
    accepts_answer,
    accepts_call,
    accepts_json_answer,
    read_thinking,
    tool_calls,
)
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine import LLM
from pdserve.engine.embedded.catalog import STORIES

GREEDY = SamplingParams(max_tokens=100, temperature=0)
QUESTIONS = [
    "Where is the cat?",
    "Where is Tom?",
    "Who is Lily?",
    "What does Ben like to do?",
    "What color is the kite?",
    "How does Mia feel?",
    "What did Sam find?",
    "Hello!",
    "Describe Zoe in JSON.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(STORIES, device="cpu", num_kv_blocks=512)


def answer(
    llm: LLM, messages: list[dict], thinking: bool | None, tools: tuple[dict, ...] = ()
) -> tuple[str, str]:
    """The greedy reply (its text, decoded without special tokens, which keeps </think>) and its
    finish reason, to the conversation rendered as the server renders it."""
    kwargs: dict = {"tools": list(tools)} if tools else {}
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    text = llm.tokenizer.apply_chat_template(messages, **kwargs)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    (out,) = llm.generate([ids], GREEDY)
    return out.text, out.finish_reason


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_with_thinking_on_it_states_facts_then_answers(llm):
    for question in QUESTIONS:
        text, finish = answer(llm, ask(question), thinking=True)
        assert finish == "stop", f"{question!r}: no end in 100 tokens: {text!r}"
        r = read_thinking(text)
        assert r.accepted and "<think>" not in text, f"{question!r}: {text!r}"
        assert text.count("</think>") == 1 and "\n</think>\n\n" in text, text
        if "JSON" in question:
            assert accepts_json_answer(r.answer) and json.loads(r.answer)["name"] == "Zoe", text
        else:
            assert not r.answer.startswith(("{", "<tool_call>")), text


@pytest.mark.parametrize("thinking", [None, False], ids=["undefined", "false"])
def test_with_thinking_off_it_answers_as_before(llm, thinking):
    for question in QUESTIONS:
        text, finish = answer(llm, ask(question), thinking=thinking)
        assert finish == "stop", f"{question!r}: no end in 100 tokens: {text!r}"
        assert "</think>" not in text and "<think>" not in text, f"{question!r}: {text!r}"
        assert accepts_answer(text), f"{question!r}: {text!r}"
        if "JSON" in question:
            assert accepts_json_answer(text) and json.loads(text)["name"] == "Zoe", text


@pytest.mark.parametrize("character", ["cat", "fox", "Tom"])
def test_with_thinking_on_it_reasons_which_call_it_needs_then_calls_and_answers_the_result(
    llm, character
):
    question = f"Where is {character}?" if character[0].isupper() else f"Where is the {character}?"
    text, finish = answer(llm, ask(question), thinking=True, tools=grammar.TOOLS)
    r = read_thinking(text)
    assert r.accepted and finish == "stop", text
    assert r.reasoning.accepted[-1].startswith("I need where_is for"), text
    (call,) = tool_calls(r.answer)
    assert accepts_call(call) and call["arguments"] == {"character": character}, text
    # Given the result (the call turn in the history, its reasoning dropped), it reasons from it.
    messages = ask(question) + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
        {"role": "tool", "content": json.dumps({"place": "garden"})},
    ]
    text, finish = answer(llm, messages, thinking=True, tools=grammar.TOOLS)
    r = read_thinking(text)
    assert r.accepted and finish == "stop", text
    assert "garden" in r.answer and not tool_calls(r.answer), text
    off, _ = answer(llm, messages, thinking=False, tools=grammar.TOOLS)
    assert "</think>" not in off and accepts_answer(off) and "garden" in off, off


def test_with_thinking_off_and_the_tool_offered_it_calls_at_once(llm):
    text, finish = answer(llm, ask("Where is the dog?"), thinking=None, tools=grammar.TOOLS)
    assert "</think>" not in text and text.startswith("<tool_call>"), text
    (call,) = tool_calls(text)
    assert call == {"name": "where_is", "arguments": {"character": "dog"}}
