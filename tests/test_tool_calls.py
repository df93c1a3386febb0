"""Tool calling: a request's tools and tool_choice planned before it runs (a required or named
choice enforced by a constraint over the functions' schemas), the model's own call formats parsed
(hermes, llama3_json, mistral), streamed as OpenAI's tool-call deltas; and, over HTTP with the
official client, named and required calls, streamed and not, `auto` calls the embedded model makes
and answers from, a conversation that carries a tool's result, and every bad input a 400 naming
its field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from pdserve.bench.stories import grammar
from pdserve.bench.stories.recognizer import accepts_call, read
from pdserve.coordinator.structured_request import ConstraintRequestError
from pdserve.coordinator.tool_call_stream import ToolCallStream
from pdserve.coordinator.tool_choice import CALLS_PER_TOOL, ToolPlan, plan_tools
from pdserve.coordinator.tool_parsers import PARSERS, ToolCall
from pdserve.tune.local_server import PdserveServer, PdserveSystem

pytestmark = pytest.mark.cluster

WHERE_IS = {
    "type": "object",
    "properties": {"character": {"enum": ["cat", "dog", "bird"]}},
    "required": ["character"],
    "additionalProperties": False,
}
FIND = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}},
    "required": ["name"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "where_is", "parameters": WHERE_IS}},
    {"type": "function", "function": {"name": "find_animal", "parameters": FIND}},
]
SCHEMAS = {"where_is": WHERE_IS, "find_animal": FIND}


# --- the plan --------------------------------------------------------------------------------


def test_required_and_named_choices_are_constraints_over_the_functions_schemas():
    plan = plan_tools(TOOLS, "required", False, False, None)
    schema = json.loads(plan.constraint.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = plan_tools(
        TOOLS, {"type": "function", "function": {"name": "find_animal"}}, None, False, None
    )
    assert json.loads(named.constraint.spec) == FIND and named.function == "find_animal"
    text = '[{"name": "where_is", "parameters": {"character": "cat"}}, {"name": "find_animal", "parameters": {"name": "Finn"}}]'
    assert plan.calls(text) == (
        None,
        [ToolCall("where_is", '{"character": "cat"}'), ToolCall("find_animal", '{"name": "Finn"}')],
    )


def test_required_with_parallel_calls_is_an_array_the_grammar_closes_at_a_bound():
    """A model that keeps appending calls is stopped by the grammar closing the array, not by
    max_tokens: one call without parallel calls, CALLS_PER_TOOL per tool with them."""
    for parallel in (None, True):
        schema = json.loads(plan_tools(TOOLS, "required", parallel, False, None).constraint.spec)
        assert (schema["minItems"], schema["maxItems"]) == (1, CALLS_PER_TOOL * len(TOOLS))
    one = json.loads(plan_tools(TOOLS, "required", False, False, None).constraint.spec)
    assert (one["minItems"], one["maxItems"]) == (1, 1)


CALLS = [
    '{"name": "where_is", "parameters": {"character": "cat"}}',
    '{"name": "find_animal", "parameters": {"name": "Finn"}}',
]


@pytest.mark.parametrize(
    "text,whole",
    [
        (f"[{CALLS[0]}, {CALLS[1]}]", 2),
        (f"[{CALLS[0]}, {CALLS[1][:-1]}", 1),  # cut before the last brace
        (f"[{CALLS[0]}, {CALLS[1]}", 2),  # cut before the array's end
        (f"[{CALLS[0]},", 1),
        (f"[{CALLS[0]}", 1),
        (f"[{CALLS[0][:20]}", 0),
        ("[", 0),
    ],
    ids=["whole", "cut-in-call", "cut-before-end", "cut-after-comma", "one", "cut-first", "open"],
)
def test_a_required_output_cut_short_is_its_whole_calls(text, whole):
    """finish_reason length: the calls written whole come back as tool_calls, the cut one is
    dropped, and none of the array's JSON is content."""
    content, calls = plan_tools(TOOLS, "required", None, False, None).calls(text)
    expected = [
        ToolCall("where_is", '{"character": "cat"}'),
        ToolCall("find_animal", '{"name": "Finn"}'),
    ]
    assert content is None and calls == expected[:whole]
    stream = ToolCallStream(plan_tools(TOOLS, "required", None, False, None))
    delta = stream.delta(text, finished=True)
    assert "content" not in delta
    streamed = [
        ToolCall(c["function"]["name"], c["function"]["arguments"])
        for c in delta.get("tool_calls", [])
    ]
    assert streamed == expected[:whole]
    assert stream.finish_reason("length") == "length"


def test_without_tool_choice_a_request_is_auto_where_the_server_enables_it():
    assert plan_tools(TOOLS, None, None, True, "hermes").mode == "auto"
    assert plan_tools(TOOLS, None, None, False, None).mode == "none"
    assert plan_tools(None, None, None, True, "hermes").mode == "none"


@pytest.mark.parametrize(
    "tools,choice,auto,param,named",
    [
        (TOOLS, {"type": "function", "function": {"name": "fly"}}, False, "tool_choice", "fly"),
        (TOOLS, "auto", False, "tool_choice", "--enable-auto-tool-choice"),
        (TOOLS, "sometimes", False, "tool_choice", "required"),
        ([{"type": "function"}], "required", False, "tools", "every tool"),
        ([TOOLS[0], TOOLS[0]], "required", False, "tools", "two tools"),
        (None, "required", False, "tool_choice", "needs tools"),
    ],
)
def test_a_tool_request_that_cannot_be_taken_names_its_field(tools, choice, auto, param, named):
    with pytest.raises(ConstraintRequestError, match=named) as caught:
        plan_tools(tools, choice, None, auto, "hermes" if auto else None)
    assert caught.value.param == param


# --- the model's own formats -------------------------------------------------------------------


@pytest.mark.parametrize(
    "parser,text,content",
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "where_is", "arguments": {"character": "cat"}}\n</tool_call>\n<tool_call>\n{"name": "find_animal", "arguments": {"name": "Finn"}}\n</tool_call>',
            "Let me look.",
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "where_is", "parameters": {"character": "cat"}}; {"name": "find_animal", "parameters": {"name": "Finn"}}',
            "",
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "where_is", "arguments": {"character": "cat"}}, {"name": "find_animal", "arguments": {"name": "Finn"}}]',
            "",
        ),
    ],
)
def test_each_parser_reads_parallel_calls_and_streams_the_text_before_them(parser, text, content):
    calls = [
        ToolCall("where_is", '{"character": "cat"}'),
        ToolCall("find_animal", '{"name": "Finn"}'),
    ]
    assert PARSERS[parser]().parse(text) == (content, calls)
    stream = ToolCallStream(ToolPlan("auto", parser=PARSERS[parser]()))
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    deltas = [stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(d.get("content", "") for d in deltas) == content
    streamed: dict[int, dict] = {}
    for entry in (c for d in deltas for c in d.get("tool_calls", [])):
        call = streamed.setdefault(entry["index"], {"ids": [], "name": None, "arguments": ""})
        if "id" in entry:
            call["ids"].append(entry["id"])
            call["name"] = entry["function"]["name"]
        call["arguments"] += entry["function"]["arguments"]
    assert [(i, c["name"], json.loads(c["arguments"])) for i, c in streamed.items()] == [
        (0, "where_is", {"character": "cat"}),
        (1, "find_animal", {"name": "Finn"}),
    ]
    assert all(len(c["ids"]) == 1 and c["ids"][0].startswith("call_") for c in streamed.values())
    assert stream.finish_reason("stop") == "tool_calls"


def test_text_that_only_looks_like_a_call_stays_text():
    for parser in PARSERS.values():
        assert parser().parse("The cat is near the river.") == ("The cat is near the river.", [])
    stream = ToolCallStream(ToolPlan("auto", parser=PARSERS["hermes"]()))
    deltas = [stream.delta("I see <tool", False), stream.delta("box> here.", True)]
    assert "".join(d.get("content", "") for d in deltas) == "I see <toolbox> here."
    assert stream.finish_reason("stop") == "stop"


# --- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    system = PdserveSystem(
        "tools", flags=("--insecure", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    )
    with PdserveServer(system, tmp_path_factory.mktemp("tools"), "pdserve-stories") as server:
        yield OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def assemble(stream) -> tuple[str | None, str, dict[int, dict]]:
    """(finish reason, content, calls by index) of a streamed chat completion; each call with
    the number of chunks its arguments came in."""
    finish, content, calls = None, "", {}
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(
                    call.index, {"id": None, "name": "", "arguments": "", "chunks": 0}
                )
                entry["id"] = call.id or entry["id"]
                entry["name"] = (call.function.name or "") or entry["name"]
                entry["arguments"] += call.function.arguments or ""
                entry["chunks"] += bool(call.function.arguments)
    return finish, content, calls


@pytest.mark.parametrize(
    "choice",
    [
        "required",
        {"type": "function", "function": {"name": "where_is"}},
        {"type": "function", "function": {"name": "find_animal"}},
    ],
)
def test_named_and_required_calls_whole_and_streamed(client, choice):
    model = client.models.list().data[0].id
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "Where is the cat?"}],
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "tool_calls"
    (call,) = out.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(choice, dict):
        assert call.function.name == choice["function"]["name"]
    finish, content, calls = assemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (call.function.name, json.loads(call.function.arguments))
    ]
    assert calls[0]["id"].startswith("call_")


def test_required_parallel_calls_end_at_the_bound_and_a_cut_response_keeps_its_whole_calls(
    client,
):
    """pdserve-stories, asked for required calls with parallel calls on, keeps appending calls:
    the grammar closes the array at its bound (finish_reason tool_calls, not length). Cut by
    max_tokens, the response is the calls written whole, as tool_calls; the cut one is dropped
    and none of the array's JSON is content. Streamed, the calls written whole come the same,
    and the cut one, if it had begun to stream, as far as it went."""
    model = client.models.list().data[0].id
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "Where is the cat?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
    )
    whole = client.chat.completions.create(max_tokens=900, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert len(whole.message.tool_calls) == CALLS_PER_TOOL * len(TOOLS)
    every = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    for name, arguments in every:
        jsonschema.validate(arguments, SCHEMAS[name])
    cut = client.chat.completions.create(max_tokens=100, **kwargs).choices[0]
    assert cut.finish_reason == "length" and not cut.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in cut.message.tool_calls]
    assert 1 <= len(calls) < len(every) and calls == every[: len(calls)]
    finish, content, streamed = assemble(
        client.chat.completions.create(stream=True, max_tokens=100, **kwargs)
    )
    assert finish == "length" and content == ""
    streamed = list(streamed.values())
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed[: len(calls)]] == calls
    assert len(streamed) <= len(calls) + 1 and all(c["name"] in SCHEMAS for c in streamed)


@pytest.mark.parametrize("character", ["cat", "fox", "Tom"])
def test_auto_the_embedded_model_calls_its_tool_and_answers_from_the_result(client, character):
    """pdserve-stories learned to call `where_is` when a request offers it: under `auto` it makes
    the call the story grammar's recognizer accepts, for the character asked about, whole and
    streamed (its arguments in several chunks, as written); given the tool's result it answers in
    a sentence of its grammar from that result."""
    model = client.models.list().data[0].id
    question = f"Where is {character}?" if character[0].isupper() else f"Where is the {character}?"
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": question}],
        tools=list(grammar.TOOLS),
        max_tokens=60,
        temperature=0,
    )
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "tool_calls" and not out.message.content
    (call,) = out.message.tool_calls
    made = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
    assert accepts_call(made) and made["arguments"] == {"character": character}
    finish, content, calls = assemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (made["name"], made["arguments"])
    ]
    assert calls[0]["chunks"] > 1
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"place": "garden"})}
    kwargs["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        result,
    ]
    answer = client.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    reading = read(answer.message.content)
    assert reading.rejected == [] and reading.accepted and "garden" in answer.message.content


def test_auto_a_question_the_tool_does_not_answer_gets_text(client):
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What does Mia like to do?"}],
        tools=list(grammar.TOOLS),
        max_tokens=40,
        temperature=0,
    ).choices[0]
    assert out.finish_reason == "stop" and out.message.tool_calls is None
    reading = read(out.message.content)
    assert reading.rejected == [] and reading.accepted


def test_a_conversation_carries_a_tools_result_and_tool_choice_none_writes_text(client):
    model = client.models.list().data[0].id
    messages = [
        {"role": "user", "content": "Where is the cat?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "where_is", "arguments": '{"character": "cat"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "The cat is near the river."},
    ]
    out = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_a_bad_tool_request_is_a_400_naming_its_field(client, extra, param):
    base = str(client.base_url).rstrip("/")
    body = {
        "model": client.models.list().data[0].id,
        "max_tokens": 8,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
    }
    response = httpx.post(f"{base}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "cond"}}])
def test_a_tool_schema_the_constraint_cannot_enforce_is_refused_naming_tools(choice):
    """A keyword the compiler would not enforce, in a forced tool's parameters, is a 400 naming
    tools (it was a 500: found by fuzzing /v1/messages/count_tokens)."""
    cond = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    tools = [{"type": "function", "function": {"name": "cond", "parameters": cond}}]
    with pytest.raises(ConstraintRequestError, match="'if'|'then'") as info:
        plan_tools(tools, choice, None, False, None)
    assert info.value.param == "tools"
