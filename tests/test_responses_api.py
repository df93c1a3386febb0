"""The OpenAI Responses API (`/v1/responses`) over the chat path, for real: `pdserve serve` on
pdserve-stories with auto tool choice, driven by the official `openai` client and httpx: a
response equals the chat completion of the same messages (whole and streamed as typed events),
a function tool's round trip by previous_response_id and by the whole input, structured output,
required calls, the bounded store (GET, DELETE, store false, expiry by a live setting), and bad
inputs refused with the OpenAI error body naming their field, holding nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import jsonschema
import pytest
from openai import OpenAI
from served_metrics import idle as served_idle
from waiting import wait_until

from pdserve.bench.stories import grammar
from pdserve.bench.stories.recognizer import read
from pdserve.coordinator.chat_output import ChatOutputStream
from pdserve.coordinator.choice_stream import ChoiceDelta
from pdserve.coordinator.openai_protocol import APIError
from pdserve.coordinator.reasoning_parsers import PARSERS as REASONING_PARSERS
from pdserve.coordinator.response_store import ResponseStore
from pdserve.coordinator.responses_protocol import ResponsesRequest
from pdserve.coordinator.serving_responses import OpenAIServingResponses, ResponseEventStream
from pdserve.coordinator.tool_choice import ToolPlan, plan_tools
from pdserve.tune.local_server import PdserveServer, PdserveSystem

pytestmark = pytest.mark.cluster

CONFIG = {"heartbeat_interval_s": 0.05}
WHERE_IS = grammar.TOOLS[0]["function"]
# The Responses API's function tools are flat.
TOOLS = [{"type": "function", **WHERE_IS}]
PLACE = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["cat", "dog"]},
        "place": {"type": "string", "maxLength": 12},
    },
    "required": ["animal", "place"],
    "additionalProperties": False,
}


class Served:
    def __init__(self, server: PdserveServer) -> None:
        self.server = server
        self.url = server.base_url
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def reload(self, **config: object) -> None:
        """New live settings: the config file rewritten, then SIGHUP."""
        system = self.server.system
        system.config = {**CONFIG, **config}
        (self.server.work_dir / "pdserve.toml").write_text(system.config_toml())
        self.server.proc.send_signal(signal.SIGHUP)

    def idle(self) -> bool:
        """Every KV block free and no request left at the coordinator."""
        return served_idle(self.url)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    system = PdserveSystem(
        "responses",
        config=dict(CONFIG),
        flags=("--insecure", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    )
    with PdserveServer(system, tmp_path_factory.mktemp("responses"), "pdserve-stories") as server:
        yield Served(server)


def check_event_order(events: list) -> None:
    """Numbered from 0; created and in_progress first, one end event last; each item's and part's
    events between its added and its done."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    open_items: set[int] = set()
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert not open_items  # one item at a time
            open_items.add(e.output_index)
        elif e.type == "response.output_item.done":
            open_items.remove(e.output_index)
        else:
            assert e.output_index in open_items, e.type
    assert not open_items


# --- the events, without a model -------------------------------------------------------------


def parse_events(text: str) -> list[dict]:
    """SSE text as its events: each `event:` line names the type its `data:` carries."""
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def test_reasoning_content_and_a_call_stream_as_three_items_in_turn():
    """With a reasoning parser and hermes calls, one output is a reasoning item, a message and a
    function call, each opened, written and closed before the next; their done events and the
    items carry the whole text."""
    chat_tools = [{"type": "function", "function": WHERE_IS}]
    tools = plan_tools(chat_tools, "auto", None, True, "hermes")
    reasoning = REASONING_PARSERS["deepseek_r1"]().plan("<|im_start|>assistant\n")
    stream = ResponseEventStream(ChatOutputStream(tools, reasoning))
    call = '<tool_call>\n{"name": "where_is", "arguments": {"character": "cat"}}\n</tool_call>'
    pieces = ["I should ", "look.</think>", "Let me ", "see. ", call[:20], call[20:]]
    text = "".join(
        "".join(stream.feed(piece, "stop" if i == len(pieces) - 1 else None))
        for i, piece in enumerate(pieces)
    )
    events = parse_events(text)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events] == [0] * 7 + [1] * 7 + [2] * 4
    thought, message, made = stream.items
    assert thought["content"] == [{"type": "reasoning_text", "text": "I should look."}]
    assert message["content"][0]["text"] == "Let me see."
    assert (made["name"], json.loads(made["arguments"])) == ("where_is", {"character": "cat"})
    assert made["call_id"].startswith("call_") and made["status"] == "completed"
    assert events[-1]["item"] == made


class FailingChoice:
    """A choice whose stream fails after one piece, as a node lost past its retries does."""

    finish_reason = None
    aborted = 0

    async def deltas(self):
        yield ChoiceDelta(0, "Once")
        raise APIError(503, "no node is available", "service_unavailable", code="unavailable")

    async def abort(self) -> None:
        self.aborted += 1


class StubServing:
    async def abort(self, choices: list) -> None:
        for choice in choices:
            await choice.abort()


def test_an_error_mid_stream_ends_it_with_an_error_event_and_aborts():
    responses = OpenAIServingResponses.__new__(OpenAIServingResponses)
    responses.serving = StubServing()
    choice = FailingChoice()
    body = ResponsesRequest(input="Hi", stream=True)
    events = responses._events(body, ToolPlan("none"), None, [choice], {"id": "resp_x"}, [])

    async def drain() -> str:
        return "".join([e async for e in events])

    out = parse_events(asyncio.run(drain()))
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "error",
    ]
    assert (out[-1]["code"], out[-1]["message"]) == ("unavailable", "no node is available")
    assert choice.aborted == 1


# --- text -----------------------------------------------------------------------------------


def test_a_response_is_the_chat_completion_of_the_same_messages_whole_and_streamed(served):
    client, model = served.client, served.model
    instructions, question = "You tell stories.", "Tell me about Mia."
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": question},
        ],
        temperature=0,
        max_tokens=48,
    )
    kwargs = dict(
        model=model, instructions=instructions, input=question, temperature=0, max_output_tokens=48
    )
    response = client.responses.create(**kwargs)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == model and response.instructions == instructions
    assert response.output_text == chat.choices[0].message.content
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0

    events = list(client.responses.create(stream=True, **kwargs))
    check_event_order(events)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) > 1
    done = events[-1].response
    assert "".join(deltas) == events[-4].text == done.output_text == response.output_text
    assert done.status == response.status
    assert done.usage.output_tokens == response.usage.output_tokens


def test_a_response_cut_by_max_output_tokens_is_incomplete(served):
    kwargs = dict(model=served.model, input="Tell me a story.", max_output_tokens=3)
    response = served.client.responses.create(**kwargs)
    assert response.status == "incomplete" and response.usage.output_tokens == 3
    assert response.incomplete_details.reason == "max_output_tokens"
    events = list(served.client.responses.create(stream=True, **kwargs))
    check_event_order(events)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_text_format_json_schema_gives_valid_json(served):
    response = served.client.responses.create(
        model=served.model,
        input="Where is the cat?",
        text={"format": {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), PLACE)
    assert response.text.format.type == "json_schema"


# --- tools ----------------------------------------------------------------------------------


def the_call(response) -> object:
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.status == "completed"
    return call


def test_a_function_tool_round_trip_by_previous_response_id_and_by_the_whole_input(served):
    """pdserve-stories calls `where_is` for the cat; given the tool's output it answers from it,
    the same whether the conversation comes from the store or is sent whole."""
    client, model = served.client, served.model
    question = {"role": "user", "content": "Where is the cat?"}
    first = client.responses.create(
        model=model, input=[question], tools=TOOLS, temperature=0, max_output_tokens=60
    )
    call = the_call(first)
    assert call.name == "where_is" and json.loads(call.arguments) == {"character": "cat"}
    assert first.status == "completed" and first.tools[0].name == "where_is"
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": json.dumps({"place": "garden"}),
    }
    kwargs = dict(model=model, tools=TOOLS, temperature=0, max_output_tokens=60)
    answer = client.responses.create(previous_response_id=first.id, input=[result], **kwargs)
    assert answer.previous_response_id == first.id
    assert not [item for item in answer.output if item.type == "function_call"]
    reading = read(answer.output_text)
    assert reading.rejected == [] and reading.accepted and "garden" in answer.output_text
    whole = [question, *(item.model_dump(exclude_none=True) for item in first.output), result]
    again = client.responses.create(input=whole, store=False, **kwargs)
    assert again.output_text == answer.output_text
    assert again.usage.input_tokens == answer.usage.input_tokens

    # Streamed: the call's item, its arguments as deltas, then done.
    events = list(client.responses.create(input=[question], stream=True, **kwargs))
    check_event_order(events)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"] and added[0].name == "where_is"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == json.loads(args_done.arguments) == {"character": "cat"}
    assert the_call(events[-1].response).arguments == args_done.arguments


def test_tool_choice_required_gives_a_call(served):
    response = served.client.responses.create(
        model=served.model,
        input="Tell me a story.",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    call = the_call(response)
    assert call.name == "where_is" and set(json.loads(call.arguments)) == {"character"}
    assert response.tool_choice == "required" and response.parallel_tool_calls is False
    named = served.client.responses.create(
        model=served.model,
        input="Tell me a story.",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "where_is"},
        max_output_tokens=60,
        temperature=0,
    )
    assert the_call(named).name == "where_is"


# --- the store --------------------------------------------------------------------------------


def test_stored_responses_are_got_and_deleted_and_store_false_keeps_none(served):
    client, model = served.client, served.model
    kwargs = dict(model=model, input="Hi", max_output_tokens=4, metadata={"run": "7"})
    response = client.responses.create(**kwargs)
    assert response.metadata == {"run": "7"}
    got = httpx.get(f"{served.url}/v1/responses/{response.id}")
    assert got.status_code == 200 and got.json()["id"] == response.id
    assert got.json()["output"] == [
        item.model_dump(mode="json", exclude_none=True) for item in response.output
    ]
    assert client.responses.retrieve(response.id).output_text == response.output_text
    unknown = httpx.get(f"{served.url}/v1/responses/resp_nope")
    assert unknown.status_code == 404 and "resp_nope" in unknown.json()["error"]["message"]
    unstored = client.responses.create(store=False, **kwargs)
    assert httpx.get(f"{served.url}/v1/responses/{unstored.id}").status_code == 404
    assert httpx.delete(f"{served.url}/v1/responses/{response.id}").status_code == 200
    assert httpx.get(f"{served.url}/v1/responses/{response.id}").status_code == 404
    assert httpx.delete(f"{served.url}/v1/responses/{response.id}").status_code == 404


def test_a_stored_response_expires_after_its_live_ttl(served):
    client = served.client
    served.reload(stored_response_ttl_s=1.0)
    try:
        # The reload lands when a response stored now is gone a second later.
        def expired() -> bool:
            response = client.responses.create(model=served.model, input="Hi", max_output_tokens=2)
            time.sleep(1.2)
            return httpx.get(f"{served.url}/v1/responses/{response.id}").status_code == 404

        wait_until(expired, "the reloaded ttl to expire a stored response", poll_s=0)
        old = client.responses.create(model=served.model, input="Hi", max_output_tokens=2)
        time.sleep(1.2)
        r = httpx.post(
            f"{served.url}/v1/responses",
            json={"model": served.model, "input": "Hi", "previous_response_id": old.id},
        )
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        assert old.id in r.json()["error"]["message"]
    finally:
        served.reload()


def test_the_store_drops_the_least_recently_used_and_the_expired():
    now = [0.0]
    limits = [2, 10.0]
    store = ResponseStore(lambda: tuple(limits), clock=lambda: now[0])
    store.put("a", {"id": "a"}, [])
    store.put("b", {"id": "b"}, [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", {"id": "c"}, [])
    assert store.get("b") is None and store.get("a") and store.get("c")
    now[0] = 11.0
    assert store.get("a") is None and len(store) == 0
    store.put("d", {"id": "d"}, [])
    limits[0] = 0  # a live reload to none kept
    assert store.get("d") is None


# --- refusals ---------------------------------------------------------------------------------

BAD_INPUTS = [
    ({}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input"),
    ({"input": [{"type": "function_call_output", "output": "{}"}]}, 400, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    (
        {"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "fly"}},
        400,
        "tool_choice",
    ),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "Hi", "temperature": 3}, 400, "temperature"),
    ({"input": "Hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "Hi", "background": True}, 400, "background"),
    ({"input": "Hi", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
]


def test_bad_inputs_get_the_openai_error_body_naming_their_field_and_hold_nothing(served):
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for body, status, param in BAD_INPUTS:
            r = http.post("/v1/responses", json={"model": served.model, **body})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body, error)
        schema = http.get("/openapi.json").json()
        assert "ResponsesRequest" in schema["components"]["schemas"]
    response = served.client.responses.create(model=served.model, input="Hi", max_output_tokens=4)
    assert response.status in ("completed", "incomplete") and response.output_text
    wait_until(served.idle, "every KV block free and no request left at the coordinator")
