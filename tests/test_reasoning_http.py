"""Reasoning over HTTP with the embedded model, which thinks when its chat template is asked to
(`chat_template_kwargs: {"enable_thinking": true}`), served with `--reasoning-parser qwen3` by one
prefill and one decode node: the thinking arrives in `reasoning_content`, streamed and not, the
answer in `content`; a JSON schema constrains the answer only (the reasoning stays free text); a
tool call is parsed from the answer only; thinking off changes nothing; usage counts the
reasoning's tokens; and the Responses and Messages APIs give the same reasoning as a `reasoning`
item and a `thinking` block."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from pdserve.bench.stories import grammar
from pdserve.bench.stories.recognizer import accepts_call, read, read_thinking
from pdserve.tune.local_server import PdserveServer, PdserveSystem

pytestmark = pytest.mark.cluster

THINK = {"chat_template_kwargs": {"enable_thinking": True}}
WHERE = [{"role": "user", "content": "Where is the cat?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"type": "string", "maxLength": 12},
        "home": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "kind", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    flags = ("--insecure", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes")  # fmt: skip
    system = PdserveSystem("reasoning", flags=flags)
    with PdserveServer(system, tmp_path_factory.mktemp("reasoning"), "pdserve-stories") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def chat(client: OpenAI, messages: list[dict], **kwargs):  # noqa: ANN201
    return client.chat.completions.create(
        model="pdserve-stories", messages=messages, max_tokens=80, temperature=0, **kwargs
    )


def test_the_thinking_arrives_apart_from_the_answer(client):
    out = chat(client, WHERE, extra_body=THINK)
    message = out.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == reasoning
    assert reasoning and "</think>" not in reasoning and "<think>" not in reasoning
    assert read(message.content).accepted and "</think>" not in message.content
    assert read_thinking(f"{reasoning}\n</think>\n\n{message.content}").accepted
    usage = out.usage
    reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < usage.completion_tokens
    # Streamed: reasoning deltas first, then content deltas, joining to the same texts.
    stream = chat(client, WHERE, extra_body=THINK, stream=True)
    kinds, thought, answer = [], "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            kinds.append("reasoning")
            thought += extra["reasoning_content"]
        if delta.content:
            kinds.append("content")
            answer += delta.content
    assert (thought, answer) == (reasoning, message.content)
    assert kinds.index("content") > kinds.count("reasoning") - 1 > 0  # all reasoning first


def test_thinking_off_answers_as_before_with_no_reasoning(client):
    out = chat(client, WHERE)
    message = out.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") is None
    assert read(message.content).accepted and "think>" not in message.content
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
    off = chat(client, WHERE, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == message.content
    # And include_reasoning false parses the reasoning out without returning it.
    hidden = chat(client, WHERE, extra_body={**THINK, "include_reasoning": False})
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
    assert (
        hidden.choices[0].message.content
        == chat(client, WHERE, extra_body=THINK).choices[0].message.content
    )


def test_a_json_schema_constrains_the_answer_not_the_reasoning(client):
    messages = [{"role": "user", "content": "Describe Zoe in JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    for stream in (False, True):
        out = chat(
            client, messages, extra_body=THINK, response_format=response_format, stream=stream
        )
        if stream:
            reasoning = content = ""
            for chunk in out:
                if chunk.choices:
                    d = chunk.choices[0].delta
                    reasoning += (d.model_extra or {}).get("reasoning_content") or ""
                    content += d.content or ""
        else:
            message = out.choices[0].message
            reasoning, content = message.model_extra["reasoning_content"], message.content
        assert reasoning and not reasoning.lstrip().startswith("{")  # free text, not JSON
        jsonschema.validate(json.loads(content), PERSON)


def test_a_tool_call_is_parsed_from_the_answer_after_the_reasoning(client):
    out = chat(client, WHERE, tools=list(grammar.TOOLS), extra_body=THINK)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"]
    (call,) = choice.message.tool_calls
    assert call.function.name == "where_is"
    assert accepts_call({"name": "where_is", "arguments": json.loads(call.function.arguments)})
    assert "<tool_call>" not in (choice.message.content or "")


def test_the_responses_and_messages_apis_carry_the_same_reasoning(server, client):
    want = chat(client, WHERE, extra_body=THINK).choices[0].message
    response = client.responses.create(
        model="pdserve-stories",
        input="Where is the cat?",
        max_output_tokens=80,
        temperature=0,
        reasoning={"effort": "medium"},
    )
    items = {item.type: item for item in response.output}
    assert items["reasoning"].content[0].text == want.model_extra["reasoning_content"]
    assert response.output_text == want.content
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    out = messages.messages.create(
        model="pdserve-stories",
        max_tokens=80,
        messages=WHERE,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    blocks = {block.type: block for block in out.content}
    assert blocks["thinking"].thinking == want.model_extra["reasoning_content"]
    assert blocks["text"].text == want.content
