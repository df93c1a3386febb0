"""Structured outputs over the OpenAI API, as the official client sends them: `response_format`
(json_schema, json_object; the client's `parse` with a Pydantic model), and vLLM's
`structured_outputs` and `guided_*` fields on completions and chat completions, whole and
streamed. A constraint that cannot be taken is a 400 naming its field, streamed or not, and leaves
every KV block free."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from pdserve.tune.local_server import PdserveServer, PdserveSystem

pytestmark = pytest.mark.cluster

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def nested(depth: int) -> dict:
    """An object schema nested `depth` objects deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"inner": schema}, "required": ["inner"]}
    return schema


# What a user sent and pdserve once compiled for half a minute, accepting both.
NESTED_300 = nested(300)
PROPERTIES_3000 = {
    "type": "object",
    "properties": {f"field_{i:04d}": {"type": "string", "maxLength": 200} for i in range(3000)},
    "required": [f"field_{i:04d}" for i in range(3000)],
}


class Pet(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    system = PdserveSystem("structured", flags=("--insecure",))
    with PdserveServer(system, tmp_path_factory.mktemp("structured"), "pdserve-stories") as server:
        yield server.base_url


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused")


def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_response_format_json_schema_and_the_clients_parse(client):
    m = model(client)
    messages = [{"role": "user", "content": "Tell me about the cat."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(
        model=m, messages=messages, max_tokens=60, temperature=0, response_format=fmt
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    parsed = client.chat.completions.parse(
        model=m, messages=messages, max_tokens=60, temperature=0.8, seed=3, response_format=Pet
    )
    assert isinstance(parsed.choices[0].message.parsed, Pet)


def test_json_object_mode_streamed_gives_one_json_object(client):
    stream = client.chat.completions.create(
        model=model(client),
        messages=[{"role": "user", "content": "Describe Sam in JSON."}],
        max_tokens=80,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert json.loads(text)["name"] == "Sam"


@pytest.mark.parametrize(
    "body,check",
    [
        ({"guided_choice": ["cat", "dog", "bird"]}, lambda t: t in ("cat", "dog", "bird")),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        (
            {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
            lambda t: t in ("yes", "no"),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
    ],
)
def test_vllms_constraint_fields_on_completions(client, body, check):
    for stream in (False, True):
        kwargs = dict(
            model=model(client),
            prompt="Once upon a time",
            max_tokens=60,
            temperature=0,
            extra_body=body,
        )
        if stream:
            chunks = client.completions.create(stream=True, **kwargs)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert check(text), text


def kv_blocks(url: str) -> dict[str, tuple[float, float]]:
    free, total = {}, {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name, into in (("pdserve_kv_blocks_free", free), ("pdserve_kv_blocks_total", total)):
            if line.startswith(name + "{"):
                into[line.split('node="')[1].split('"')[0]] = float(line.split()[-1])
    return {node: (free.get(node), total[node]) for node in total}


@pytest.mark.parametrize(
    "body,param,named",
    [
        ({"guided_regex": "(a"}, "guided_regex", "does not compile"),
        ({"guided_choice": []}, "guided_choice", "at least one choice"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            "guided_json",
            "strin",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"guided_grammar": "root ::= oops"}, "guided_grammar", "oops"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "at most one"),
        # The default bounds (64 KiB, 32 levels), checked before anything compiles.
        ({"guided_json": NESTED_300}, "guided_json", "--max-json-schema-depth"),
        ({"guided_json": PROPERTIES_3000}, "guided_json", "--max-json-schema-bytes"),
    ],
)
def test_a_constraint_that_cannot_be_taken_is_a_400_naming_its_field(
    url, client, body, param, named
):
    for stream in (False, True):
        request = {"model": model(client), "prompt": "Once", "max_tokens": 8, "stream": stream}
        response = httpx.post(f"{url}/v1/completions", json={**request, **body}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and named in error["message"]
    deadline = time.monotonic() + 30
    while any(free != total for free, total in kv_blocks(url).values()):
        assert time.monotonic() < deadline, kv_blocks(url)
        time.sleep(0.2)
