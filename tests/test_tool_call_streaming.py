"""Streamed tool calls: each parser's format and a required choice's array, fed a few characters
at a time, go out as OpenAI's tool-call deltas as the model writes them (the name once it is
whole, then the arguments in pieces) and join to what the unstreamed response returns; content
before the calls streams as content, a cut output keeps what went out, parallel_tool_calls false
keeps the first call, and text that is not a call is never lost."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.coordinator.tool_call_stream import ToolCallStream
from pdserve.coordinator.tool_choice import ToolPlan
from pdserve.coordinator.tool_parsers import PARSERS

LONG = {"character": "cat", "note": 'a long note, with "quotes", a } brace, a ] and \\ too'}
SHORT = {"name": "Finn"}
A = f'{{"name": "where_is", "arguments": {json.dumps(LONG)}}}'
B = f'{{"name": "find_animal", "arguments": {json.dumps(SHORT)}}}'
A_PARAMS = f'{{"name": "where_is", "parameters": {json.dumps(LONG)}}}'
B_PARAMS = f'{{"name": "find_animal", "parameters": {json.dumps(SHORT)}}}'
PIECES = [1, 2, 3, 7]

OUTPUTS = {
    "hermes-one": ("hermes", f"<tool_call>\n{A}\n</tool_call>"),
    "hermes-after-content": (
        "hermes",
        f"Let me look.\n\n<tool_call>\n{A}\n</tool_call>\n<tool_call>\n{B}\n</tool_call>",
    ),
    "hermes-no-close": ("hermes", f"Looking. <tool_call>{A}"),
    "llama3-one": ("llama3_json", A_PARAMS),
    "llama3-several": ("llama3_json", f"<|python_tag|>{A_PARAMS}; {B_PARAMS}"),
    "mistral-one": ("mistral", f"[TOOL_CALLS]{A}"),
    "mistral-after-content": ("mistral", f"Sure. [TOOL_CALLS][{A}, {B}, {A}]"),
    "required-one": ("required", f"[{A_PARAMS}]"),
    "required-several": ("required", f"[\n  {A_PARAMS},\n  {B_PARAMS}\n]"),
}


def plan_for(fmt: str, parallel: bool = True) -> ToolPlan:
    if fmt == "required":
        return ToolPlan("required", parallel=parallel)
    return ToolPlan("auto", parser=PARSERS[fmt](), parallel=parallel)


def stream(plan: ToolPlan, text: str, size: int) -> list[dict]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    tool_stream = ToolCallStream(plan)
    deltas = [tool_stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    deltas.append({"finish_reason": tool_stream.finish_reason("stop")})
    return deltas


def joined(deltas: list[dict]) -> tuple[str, list[dict]]:
    """(content, calls) of a stream's deltas, each call with its ids, names, arguments and how
    many deltas before the last carried a piece of them."""
    content, calls = "", {}
    for n, delta in enumerate(deltas):
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(
                entry["index"], {"ids": [], "names": [], "arguments": "", "early": 0}
            )
            if "id" in entry:
                assert entry["type"] == "function"
                call["ids"].append(entry["id"])
                call["names"].append(entry["function"]["name"])
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {
                    "arguments"
                }
            call["arguments"] += entry["function"]["arguments"]
            if entry["function"]["arguments"] and n < len(deltas) - 2:
                call["early"] += 1
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", PIECES)
@pytest.mark.parametrize("name", list(OUTPUTS))
def test_calls_stream_as_written_and_join_to_the_unstreamed_calls(name, size):
    fmt, text = OUTPUTS[name]
    plan = plan_for(fmt)
    content, calls = plan.calls(text)
    assert calls, "the output is calls"
    deltas = stream(plan, text, size)
    streamed_content, streamed = joined(deltas)
    assert streamed_content == (content or "")
    assert len(streamed) == len(calls)
    for call, got in zip(calls, streamed, strict=True):
        assert len(got["ids"]) == 1 and got["ids"][0].startswith("call_")
        assert got["names"] == [call.name]
        assert json.loads(got["arguments"]) == json.loads(call.arguments)
        if json.loads(call.arguments) == LONG:  # long enough to be written over several pieces
            assert got["early"] > 1
    assert deltas[-1]["finish_reason"] == "tool_calls"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(OUTPUTS)), st.lists(st.integers(1, 12), min_size=1, max_size=40))
def test_any_split_of_an_output_joins_to_the_unstreamed_response(name, sizes):
    fmt, text = OUTPUTS[name]
    plan = plan_for(fmt)
    pieces, at = [], 0
    while at < len(text):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(text[at : at + size])
        at += size
    tool_stream = ToolCallStream(plan)
    deltas = [tool_stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    content, streamed = joined(deltas + [{}])
    expected_content, calls = plan.calls(text)
    assert content == (expected_content or "")
    assert [(c["names"], json.loads(c["arguments"])) for c in streamed] == [
        ([c.name], json.loads(c.arguments)) for c in calls
    ]


@pytest.mark.parametrize("size", PIECES)
def test_a_call_is_announced_once_its_name_is_whole_before_its_arguments(size):
    text = f"Hi. <tool_call>\n{A}\n</tool_call>"
    tool_stream = ToolCallStream(plan_for("hermes"))
    name_end = text.index('"where_is"') + len('"where_is"')
    fed, first = 0, None
    while fed < len(text):
        delta = tool_stream.delta(text[fed : fed + size], False)
        fed += size
        if delta.get("tool_calls") and first is None:
            first = fed, delta["tool_calls"][0]
    at, entry = first
    assert name_end <= at < name_end + size
    assert entry["function"] == {"name": "where_is", "arguments": ""}


@pytest.mark.parametrize("size", PIECES)
@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "required"])
def test_parallel_false_streams_the_first_call_only(fmt, size):
    text = {
        "hermes": f"<tool_call>{A}</tool_call>\n<tool_call>{B}</tool_call>",
        "llama3_json": f"{A_PARAMS};{B_PARAMS}",
        "mistral": f"[TOOL_CALLS][{A}, {B}]",
        "required": f"[{A_PARAMS}, {B_PARAMS}]",
    }[fmt]
    plan = plan_for(fmt, parallel=False)
    content, calls = plan.calls(text)
    _, streamed = joined(stream(plan, text, size))
    expected = calls[:1]  # a required array is one call by its grammar; here it is fed two
    assert [(c["names"], json.loads(c["arguments"])) for c in streamed] == [
        ([c.name], json.loads(c.arguments)) for c in expected
    ]


@pytest.mark.parametrize("size", PIECES)
@pytest.mark.parametrize("fmt", ["hermes", "required"])
def test_a_cut_output_ends_with_the_calls_whole_or_already_streamed(fmt, size):
    """finish_reason length: the calls written whole go out whole; the call being written when
    the output was cut stays as far as it streamed (its name, a prefix of its arguments)."""
    whole = (
        f"<tool_call>{B}</tool_call>\n<tool_call>{A}"
        if fmt == "hermes"
        else f"[{B_PARAMS}, {A_PARAMS}"
    )
    text = whole[: whole.index("a long note") + 6]
    plan = plan_for(fmt)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    tool_stream = ToolCallStream(plan)
    deltas = [tool_stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    content, streamed = joined(deltas + [{}])
    assert content == ""
    first, cut = streamed
    assert first["names"] == ["find_animal"] and json.loads(first["arguments"]) == SHORT
    assert cut["names"] == ["where_is"]
    assert text.endswith(cut["arguments"]) and cut["arguments"].startswith('{"character"')
    assert tool_stream.finish_reason("length") == "length"


def test_a_call_first_seen_in_the_last_piece_goes_out_only_whole():
    text = f"[{B_PARAMS}, {A_PARAMS}"[:-20]
    tool_stream = ToolCallStream(plan_for("required"))
    first = tool_stream.delta(text[:5], False)
    last = tool_stream.delta(text[5:], True)
    _, streamed = joined([first, last, {}])
    assert [(c["names"], json.loads(c["arguments"])) for c in streamed] == [
        (["find_animal"], SHORT)
    ]


@pytest.mark.parametrize("size", PIECES)
@pytest.mark.parametrize(
    "fmt,text",
    [
        ("hermes", "See <tool_call>not a call</tool_call> here."),
        ("llama3_json", '{"answer": 42} is the JSON.'),
        ("mistral", "[TOOL_CALLS] none today"),
    ],
)
def test_text_that_looked_like_a_call_and_was_not_is_content(fmt, text, size):
    plan = plan_for(fmt)
    assert plan.calls(text) == (text, [])
    deltas = stream(plan, text, size)
    content, calls = joined(deltas)
    assert content == text and calls == []
    assert deltas[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("size", PIECES)
@pytest.mark.parametrize(
    "after,content,streamed",
    [
        (
            '\n<tool_call>{"name": oops}</tool_call>',
            '{"name": oops}</tool_call>',
            [(["find_animal"], SHORT)],
        ),
        (  # announced once its name was whole; its arguments are not an object
            '\n<tool_call>{"name": "where_is", "arguments": 5}</tool_call>',
            '{"name": "where_is", "arguments": 5}</tool_call>',
            [(["find_animal"], SHORT), (["where_is"], None)],
        ),
        (" and more</tool_call>", " and more</tool_call>", [(["find_animal"], SHORT)]),
    ],
    ids=["not-json", "arguments-not-an-object", "more-in-the-block"],
)
def test_an_announced_call_stands_and_the_text_after_it_that_is_not_a_call_is_content(
    after, content, streamed, size
):
    """The unstreamed response makes all of this content (a block does not parse); the stream
    sent a call before that was written, and deltas cannot be taken back: the calls sent stand,
    as far as they streamed, and the text from the first object that is not a call (or from
    where the text stops being calls) is content after them, so nothing is lost."""
    text = f"Looking.\n<tool_call>\n{B}" + ("\n</tool_call>" if after[0] == "\n" else "") + after
    plan = plan_for("hermes")
    assert plan.calls(text) == (text, [])
    deltas = stream(plan, text, size)
    got_content, calls = joined(deltas)
    assert got_content == "Looking." + content
    assert [
        (c["names"], json.loads(c["arguments"]) if c["arguments"] else None) for c in calls
    ] == streamed
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("size", PIECES)
def test_text_after_an_array_of_calls_that_then_fails_to_parse_is_content(size):
    text = f"[TOOL_CALLS][{B}] and that is all"
    plan = plan_for("mistral")
    assert plan.calls(text) == (text, [])
    content, calls = joined(stream(plan, text, size))
    assert content == " and that is all"
    assert [(c["names"], json.loads(c["arguments"])) for c in calls] == [(["find_animal"], SHORT)]


def test_arguments_written_as_a_string_or_before_the_name_go_out_whole_once_parsed():
    text = (
        '<tool_call>{"name": "find_animal", "arguments": "{\\"name\\": \\"Finn\\"}"}</tool_call>'
        f'<tool_call>{{"arguments": {json.dumps(LONG)}, "name": "where_is"}}</tool_call>'
    )
    plan = plan_for("hermes")
    _, calls = plan.calls(text)
    _, streamed = joined(stream(plan, text, 2))
    assert [(c["names"], json.loads(c["arguments"])) for c in streamed] == [
        ([c.name], json.loads(c.arguments)) for c in calls
    ]
