"""Anthropic's Messages API on pdserve's HTTP server, the same request underneath as chat
completions: with the official `anthropic` client, a message whole and streamed is the greedy chat
completion's text token for token; pdserve-stories calls its tool and answers from the tool's
result; tool_choice any, stop sequences, output_config's schema, count_tokens, `x-api-key`; bad
bodies are 4xx in Anthropic's error shape naming the field, and leave every KV block free.
Thinking blocks are rendered from a reasoning parser's split, and a stream cut by shutdown ends
with an error event (both checked without a model)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import pytest
from serve_process import ServeProcess
from served_metrics import idle as served_idle
from waiting import wait_until

from pdserve.bench.stories import grammar
from pdserve.coordinator.anthropic_protocol import CountTokensRequest
from pdserve.coordinator.chat_output import ChatOutputStream, chat_output
from pdserve.coordinator.choice_stream import ChoiceDelta
from pdserve.coordinator.openai_protocol import coordinator_error
from pdserve.coordinator.reasoning_parsers import PARSERS
from pdserve.coordinator.serving_messages import (
    AnthropicServingMessages,
    BlockStream,
    content_blocks,
)
from pdserve.coordinator.stop_strings import StopStringMatcher
from pdserve.coordinator.tool_choice import ToolPlan
from pdserve.tune.local_server import SINGLE_THREAD_ENV

cluster = pytest.mark.cluster

KEY = "messages-key"
MODEL = "pdserve-stories"
BODY_LIMIT = 64 << 10
CONFIG = f"""
num_kv_blocks = 256
block_size = 8
heartbeat_interval_s = 0.05
max_request_body_bytes = {BODY_LIMIT}
"""
WHERE_IS = grammar.WHERE_IS["function"]
TOOLS = [
    {
        "name": WHERE_IS["name"],
        "description": WHERE_IS["description"],
        "input_schema": WHERE_IS["parameters"],
    }
]
QUESTION = [{"role": "user", "content": "Where is the cat?"}]
AUTH = {"x-api-key": KEY}
GREEDY = {"temperature": 0}  # (anthropic 2.14's client has no temperature argument)


@dataclass
class Server:
    url: str

    def client(self, key: str = KEY) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0)

    def post(self, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
        headers = AUTH if headers is None else headers
        if isinstance(body, bytes):
            return httpx.post(f"{self.url}{path}", content=body, headers=headers, timeout=60)
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60)

    def idle(self) -> bool:
        """Every KV block free and no request left at the coordinator."""
        return served_idle(self.url)

    def wait_until_idle(self) -> None:
        wait_until(self.idle, "every KV block free and no request left at the coordinator")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("messages")
    config, log = tmp / "pdserve.toml", tmp / "server.log"
    config.write_text(CONFIG)
    args = [MODEL, "--config", str(config), "--api-key", KEY]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    serve = ServeProcess(args, log, {**os.environ, **SINGLE_THREAD_ENV})
    try:
        serve.wait_healthy()
        yield Server(serve.url)
    finally:
        serve.stop()
        print(log.read_text()[-3000:])


def chat(server: Server, **body: object) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, headers=headers,
        timeout=60,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# --- text -------------------------------------------------------------------------------------


@cluster
def test_a_message_whole_and_streamed_is_the_greedy_chat_completion_token_for_token(server):
    client = server.client()
    kwargs = dict(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY)
    message = client.messages.create(**kwargs)
    expected = chat(server, max_tokens=40, messages=QUESTION, **GREEDY)
    choice, usage = expected["choices"][0], expected["usage"]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.model == MODEL and message.type == "message"
    assert [b.type for b in message.content] == ["text"]
    assert text_of(message) == choice["message"]["content"] and text_of(message)
    assert message.usage.output_tokens == usage["completion_tokens"]
    assert message.usage.input_tokens == usage["prompt_tokens"]
    assert message.usage.cache_creation_input_tokens == 0
    reasons = {"stop": "end_turn", "length": "max_tokens"}
    assert message.stop_reason == reasons[choice["finish_reason"]]
    assert message.stop_sequence is None
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(message)
    assert final.usage.output_tokens == message.usage.output_tokens
    assert final.stop_reason == message.stop_reason and final.id.startswith("msg_")
    server.wait_until_idle()


@cluster
def test_a_stop_sequence_ends_the_text_before_it_and_is_the_stop_reason(server):
    client = server.client()
    kwargs = dict(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY)
    full = text_of(client.messages.create(**kwargs))
    stop = " " + full.split()[2]
    cut = client.messages.create(stop_sequences=[stop, "never"], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == full[: full.index(stop)]
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(cut)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    server.wait_until_idle()


# --- tools ------------------------------------------------------------------------------------


@cluster
def test_the_model_uses_its_tool_and_answers_from_the_tool_result_whole_and_streamed(server):
    client = server.client()
    kwargs = dict(model=MODEL, max_tokens=60, messages=QUESTION, tools=TOOLS, extra_body=GREEDY)
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert (use.name, use.input) == ("where_is", {"character": "cat"})
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "where_is", {"character": "cat"})
    ]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"place": "garden"}'}
    kwargs["messages"] = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [result]},
    ]
    answer = client.messages.create(**kwargs)
    assert answer.stop_reason == "end_turn"
    assert [b.type for b in answer.content] == ["text"] and "garden" in text_of(answer)
    server.wait_until_idle()


@cluster
def test_tool_choice_any_gives_a_call_and_count_tokens_is_the_messages_input_tokens(server):
    client = server.client()
    body = dict(
        model=MODEL,
        system="You answer questions about the story world.",
        messages=[{"role": "user", "content": "What does Mia like to do?"}],
        tools=TOOLS,
    )
    # (with parallel calls, pdserve-stories keeps calling until the grammar's bound)
    choice = {"type": "any", "disable_parallel_tool_use": True}
    message = client.messages.create(max_tokens=60, tool_choice=choice, extra_body=GREEDY, **body)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name) for b in message.content] == [("tool_use", "where_is")]
    assert set(message.content[0].input) == {"character"}
    counted = client.messages.count_tokens(tool_choice=choice, **body)
    assert counted.input_tokens == message.usage.input_tokens > 0
    server.wait_until_idle()


@cluster
def test_output_config_format_constrains_the_text_to_the_schema(server):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}},
        "required": ["name"],
        "additionalProperties": False,
    }
    message = server.client().messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Describe Tom in JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), schema)
    server.wait_until_idle()


# --- keys and errors --------------------------------------------------------------------------


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, names: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert names in body["error"]["message"], body


@cluster
def test_x_api_key_and_bearer_are_the_same_keys_and_refusals_are_anthropic_errors(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION}
    for headers in (AUTH, {"Authorization": f"Bearer {KEY}"}):
        headers = {**headers, "anthropic-version": "2023-06-01"}
        assert server.post("/v1/messages", body, headers).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        response = server.post("/v1/messages", body, headers)
        assert_anthropic_error(response, 401, "authentication_error", "API key")
    with pytest.raises(anthropic.AuthenticationError) as refused:
        server.client("wrong").messages.create(**body)
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"
    big = json.dumps({**body, "system": "x" * BODY_LIMIT}).encode()
    assert_anthropic_error(server.post("/v1/messages", big), 413, "request_too_large", "bytes")
    # The chat API keeps OpenAI's shape.
    response = server.post("/v1/chat/completions", body, {})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    server.wait_until_idle()


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        "tool_use_id",
    ),
    ({"tools": [{"name": "where_is"}]}, "tools[0].input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "fly"}}, "tool_choice"),
    ({"temperature": 3}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": "1024"}}, "budget_tokens"),
    ({"max_tokens": 1 << 20}, "max_tokens"),
]


@cluster
@pytest.mark.parametrize("change,names", BAD, ids=[n for _, n in BAD])
def test_a_bad_body_is_a_400_in_anthropics_shape_naming_its_field(server, change, names):
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION, **change}
    body = {k: v for k, v in body.items() if v is not None}
    assert_anthropic_error(server.post("/v1/messages", body), 400, "invalid_request_error", names)
    if set(change) <= set(CountTokensRequest.model_fields):  # count_tokens reads them too
        body.pop("max_tokens")
        response = server.post("/v1/messages/count_tokens", body)
        assert_anthropic_error(response, 400, "invalid_request_error", names)


@cluster
def test_an_unknown_model_is_a_404_and_after_the_refusals_the_server_still_serves(server):
    body = {"model": "claude-opus", "max_tokens": 8, "messages": QUESTION}
    assert_anthropic_error(server.post("/v1/messages", body), 404, "not_found_error", "model")
    body["model"] = MODEL
    response = server.post("/v1/messages", body)
    assert response.status_code == 200 and response.json()["content"][0]["text"]
    server.wait_until_idle()


@cluster
def test_a_client_that_leaves_a_stream_frees_its_request(server):
    body = {"model": MODEL, "max_tokens": 200, "messages": QUESTION, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers=AUTH, timeout=60
    ) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
        assert json.loads(next(lines).removeprefix("data: "))["message"]["content"] == []
    server.wait_until_idle()


@cluster
def test_the_openapi_schema_lists_the_messages_bodies(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    for path, model in [
        ("/v1/messages", "MessagesRequest"),
        ("/v1/messages/count_tokens", "CountTokensRequest"),
    ]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert "messages" in schema["components"]["schemas"][model]["required"]
    assert "max_tokens" in schema["components"]["schemas"]["MessagesRequest"]["required"]
    assert "ToolResultBlockParam" in schema["components"]["schemas"]  # nested models resolve


# --- rendering, without a model ---------------------------------------------------------------


def test_reasoning_streams_as_a_thinking_block_before_the_text_and_whole_as_its_block():
    plan = PARSERS["qwen3"]().plan("<|im_start|>assistant\n<think>\n")
    output = "Mia is in the garden, so\nthe answer is there.\n</think>\n\nShe is in the garden."
    stream, blocks, events = ChatOutputStream(ToolPlan("none"), plan), BlockStream(), []
    pieces = [output[i : i + 7] for i in range(0, len(output), 7)]
    for i, piece in enumerate(pieces):
        finished = i == len(pieces) - 1
        events += blocks.feed(stream.feed(piece, finished))
    events += blocks.close()
    kinds = [(e["type"], e["index"]) for e in events if e["type"] != "content_block_delta"]
    assert kinds == [
        ("content_block_start", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_stop", 1),
    ]
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    thinking = "".join(
        e["delta"]["thinking"] for e in events if e.get("delta", {}).get("type") == "thinking_delta"
    )
    text = "".join(
        e["delta"]["text"] for e in events if e.get("delta", {}).get("type") == "text_delta"
    )
    assert thinking == "Mia is in the garden, so\nthe answer is there."
    assert text == "She is in the garden."
    assert all(e["index"] == 1 for e in events if e.get("delta", {}).get("type") == "text_delta")
    whole = content_blocks(chat_output(output, "stop", ToolPlan("none"), plan))
    assert whole == [
        {"type": "thinking", "thinking": thinking, "signature": ""},
        {"type": "text", "text": text},
    ]


class _CutChoice:
    """A choice that writes a little, then is cut by the server's shutdown."""

    index, request_id = 0, "msg-cut-0"
    num_prompt_tokens, num_cached_tokens, num_output_tokens = 5, 0, 2
    finish_reason: str | None = None
    stop = StopStringMatcher([])

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        yield ChoiceDelta(0, "The cat")
        raise coordinator_error("shutdown", "the server is shutting down")

    async def abort(self) -> None:
        self.finish_reason = "abort"


def test_a_stream_cut_by_the_servers_shutdown_ends_with_an_error_event_and_aborts():
    choice, aborted = _CutChoice(), []

    async def abort(choices: list) -> None:
        aborted.extend(choices)

    messages = AnthropicServingMessages(SimpleNamespace(abort=abort), None)  # type: ignore[arg-type]

    async def read() -> list[str]:
        events = messages._events([choice], {"id": "msg_cut"}, ToolPlan("none"), None)
        return [e async for e in events]

    events = asyncio.run(read())
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "error"]
    error = json.loads(events[-1].split("\n")[1].removeprefix("data: "))
    assert error == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the server is shutting down"},
    }
    assert aborted == [choice]
