"""The OpenAI-compatible HTTP API for real: `pdserve serve` as a subprocess (1 prefill + 1 decode
node on pdserve-tiny, started with vLLM's flags over a config file), driven by the official
`openai` package and httpx: completions, chat, tokenization, the schema, refusals, metrics and
the Grafana dashboard over them, the stats line, disconnects, and a SIGTERM that ends it all."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess
from waiting import WAIT_S, wait_until

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.embedded.tiny import ensure_tiny_model

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
# Heartbeats often, so a request's KV blocks show in /metrics soon after it starts decoding.
# max_model_len here is overridden by the flag (2040); num_kv_blocks is not (a flag > the file >
# the default, which would be a 1 GiB pool).
CONFIG = """
num_kv_blocks = 256
block_size = 8
heartbeat_interval_s = 0.05
max_model_len = 1000
max_pending_requests = {max_pending}
"""
MAX_MODEL_LEN = 2040
NAMES = ("pdserve-tiny", "tiny")
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
WORDS = (
    "the quick brown fox jumps over lazy dog hello world prefill decode worker model "
    "token cache page paris france small time"
).split()
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
ABORTED = 'pdserve_requests_finished_total{finish_reason="abort"}'


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    config: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name and labels: {'name{a="b"}': value}."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def blocks(self, m: dict[str, float] | None = None) -> tuple[int, int]:
        """Free and total KV blocks over the nodes, as their last heartbeats reported them."""
        m = self.metrics() if m is None else m
        free = sum(v for k, v in m.items() if k.startswith("pdserve_kv_blocks_free{"))
        total = sum(v for k, v in m.items() if k.startswith("pdserve_kv_blocks_total{"))
        return int(free), int(total)

    def idle(self) -> bool:
        """Every KV block free and no request left at the coordinator."""
        m = self.metrics()
        free, total = self.blocks(m)
        busy = m["pdserve_requests_running"] + m["pdserve_requests_waiting"]
        return total > 0 and free == total and busy == 0

    def decoding_with_blocks(self) -> bool:
        """A request is decoding on a node and holds KV blocks there."""
        m = self.metrics()
        free, total = self.blocks(m)
        return m["pdserve_requests_running"] >= 1 and free < total

    def wait_until_idle(self) -> None:
        wait_until(self.idle, "every KV block free and no request left at the coordinator")

    def reload(self, max_pending: int) -> None:
        self.config.write_text(CONFIG.format(max_pending=max_pending))
        self.proc.send_signal(signal.SIGHUP)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    ensure_tiny_model()  # once here, not raced by the nodes
    tmp = tmp_path_factory.mktemp("http")
    config, log = tmp / "pdserve.toml", tmp / "server.log"
    config.write_text(CONFIG.format(max_pending=512))
    template = tmp / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = ["pdserve-tiny", "--config", str(config), "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--served-model-name", *NAMES, "--chat-template", str(template)]
    serve = ServeProcess(args, log)
    try:
        serve.wait_healthy()
        yield Server(serve.proc, serve.port, config, log)
    finally:
        serve.stop()
        print(log.read_text()[-3000:])


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(num_kv_blocks=512, block_size=8)


def sse_events(response: httpx.Response) -> list[dict]:
    """The `data:` events of a raw SSE response; each must be valid UTF-8 JSON."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


# --- completions and chat ----------------------------------------------------------------------


def test_models_list_every_served_name_with_the_context_limit_of_the_flag(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == list(NAMES)
    # --max-model-len over the config file's max_model_len; the file's num_kv_blocks over the
    # default.
    assert {m.model_extra["max_model_len"] for m in models.data} == {MAX_MODEL_LEN}
    m = server.metrics()
    assert m['pdserve_kv_blocks_total{node="decode-0"}'] == 256
    # Either name serves, and the response says which was asked for.
    for name in NAMES:
        out = server.client().completions.create(model=name, prompt="Hi", max_tokens=2)
        assert out.model == name
    out = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert out.json()["model"] == NAMES[0]


def test_version_openapi_schema_and_docs(server):
    import pdserve

    assert httpx.get(f"{server.url}/version").json() == {"version": pdserve.__version__}
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert schema["info"]["version"] == pdserve.__version__
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
        "/metrics",
    ):
        assert path in schema["paths"], path
    components = schema["components"]["schemas"]
    for path, model, field in [
        ("/v1/completions", "CompletionRequest", "prompt"),
        ("/v1/chat/completions", "ChatCompletionRequest", "messages"),
    ]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert field in components[model]["properties"]
        assert field in components[model]["required"]
    assert "ChatMessage" in components  # nested models resolve
    docs = httpx.get(f"{server.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert "/openapi.json" in docs.text


def test_tokenize_and_detokenize_as_vllm_serves_them(server, offline):
    url = server.url
    text = "Hello, world"
    out = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = offline.tokenizer.encode(text)
    assert out["tokens"] == ids and out["count"] == len(ids)
    assert out["max_model_len"] == MAX_MODEL_LEN
    assert out["token_strs"] == [offline.tokenizer.id_to_token(t) for t in ids]
    plain = httpx.post(
        f"{url}/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}
    ).json()
    assert plain["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)
    assert plain["token_strs"] is None
    # Chat messages go through --chat-template, not the model's own template.
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi!"}]})
    rendered = offline.tokenizer.decode(chat.json()["tokens"], skip_special_tokens=False)
    assert rendered == "[user] Hi!\n[assistant] "
    back = httpx.post(f"{url}/detokenize", json={"tokens": out["tokens"]}).json()
    assert back == {"prompt": offline.tokenizer.decode(ids, skip_special_tokens=False)}
    assert text in back["prompt"]
    assert_error_body(httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**6]}), 400, "tokens")
    assert_error_body(httpx.post(f"{url}/tokenize", json={"prompt": 5}), 400, "prompt")
    assert_error_body(
        httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"}), 404, "model"
    )


def test_streamed_completion_equals_the_non_streamed_one(server, offline):
    client = server.client()
    whole = client.completions.create(
        model="pdserve-tiny", prompt="Hello, world", max_tokens=24, **GREEDY
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens == len(offline.tokenizer.encode("Hello, world"))
    chunks = list(
        client.completions.create(
            model="pdserve-tiny",
            prompt="Hello, world",
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_every_streamed_chunk_is_valid_utf8_json(server):
    # Token ids as the prompt; the raw bytes of the stream, strictly decoded.
    body = {
        "prompt": [5, 200, 301, 77],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    tokens = whole["choices"][0]["logprobs"]["tokens"]
    # The output really has characters split across tokens (greedy, fixed weights: always).
    assert any(t.startswith("bytes:") for t in tokens)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        raw = r.read()
    pieces = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            pieces.append(
                json.loads(line[6:].decode("utf-8", errors="strict"))["choices"][0]["text"]
            )
    for piece in pieces:
        piece.encode("utf-8")  # no lone surrogates
    # A character split across tokens is never cut in two: no chunk ends mid-character (only
    # the flush at the very end may show an unfinished one as U+FFFD).
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])
    assert "".join(pieces) == whole["choices"][0]["text"]


def test_chat_streamed_and_not(server):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(
        model="pdserve-tiny", messages=messages, max_completion_tokens=20, **GREEDY
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 20
    stream = client.chat.completions.create(
        model="pdserve-tiny",
        messages=messages,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_choices_are_seeded_and_indexed(server):
    client = server.client()
    kwargs = dict(
        model="pdserve-tiny",
        prompt="Once upon a time",
        max_tokens=12,
        n=3,
        seed=11,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # seeds seed, seed+1, seed+2 differ
    assert first.usage.completion_tokens == 36
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in first.choices]
    chat = client.chat.completions.create(
        model="pdserve-tiny",
        messages=[{"role": "user", "content": "hello"}],
        n=2,
        max_tokens=8,
        seed=3,
        temperature=1.0,
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_strings_cut_the_text_in_both_modes_and_free_the_request(server):
    client = server.client()
    kwargs = dict(model="pdserve-tiny", prompt="The quick brown fox", max_tokens=40, **GREEDY)
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 12
    stop = full[8:11]  # almost surely spans a token boundary
    expected = full[: full.index(stop)]
    cut = client.completions.create(**kwargs, stop=[stop, "\x00never"])
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 40
    chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    server.wait_until_idle()  # the stopped requests were aborted on the nodes
    assert server.metrics()['pdserve_requests_finished_total{finish_reason="stop"}'] >= 2


def test_logprobs_for_completions_and_chat(server):
    client = server.client()
    out = client.completions.create(
        model="pdserve-tiny", prompt="Hello", max_tokens=10, logprobs=3, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the top token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(
        model="pdserve-tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 for c in content)
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content
    streamed = list(
        client.chat.completions.create(
            model="pdserve-tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=10,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            **GREEDY,
        )
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == [c.token for c in content]


def test_32_concurrent_streams_match_the_offline_engine(server, offline):
    import random

    rng = random.Random(3)
    prompts: list = [" ".join(rng.choices(WORDS, k=rng.randrange(2, 30))) for _ in range(16)]
    prompts += [[rng.randrange(4, 500) for _ in range(rng.randrange(3, 60))] for _ in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompts, params)]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def one(prompt) -> str:  # noqa: ANN001
            stream = await client.completions.create(
                model="pdserve-tiny", prompt=prompt, max_tokens=16, stream=True, **GREEDY
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(run()) == expected
    server.wait_until_idle()


# --- refusals ------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (path, body: dict or raw bytes, status, param)
    (COMPLETIONS, b'{"prompt": "hi", ', 400, None),
    (CHAT, b"not json at all", 400, None),
    (COMPLETIONS, b"[1, 2, 3]", 400, None),
    (COMPLETIONS, {"max_tokens": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "n": 1.5}, 400, "n"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"prompt": "hi", "stop": [1, 2]}, 400, "stop"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": [], "max_tokens": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),  # refused even though BOS would fill it
    (COMPLETIONS, {"prompt": ["hi", ""]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[5, 6], []]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, 99999]}, 400, "prompt"),
    (
        COMPLETIONS,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (COMPLETIONS, {"prompt": list(range(4, 504)) * 5}, 400, "prompt"),  # 2500 > 2048 tokens
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    (CHAT, {"messages": [], "max_tokens": 5}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": HI, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": HI, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 2100}]}, 400, "messages"),
    (CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model"),
    (COMPLETIONS, {"model": "nope", "prompt": "hi"}, 404, "model"),
]


def assert_error_body(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param
    return error


def test_bad_inputs_get_their_status_and_error_body_and_hold_nothing(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, param in BAD_INPUTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert_error_body(r, status, param)
        r = http.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["type"]
        # The openai client surfaces them as its own exceptions.
        with pytest.raises(openai.NotFoundError):
            server.client(max_retries=0).completions.create(model="other", prompt="x")
        with pytest.raises(openai.BadRequestError):
            server.client(max_retries=0).chat.completions.create(model="pdserve-tiny", messages=[])
        assert http.get("/health").status_code == 200
    server.wait_until_idle()


def test_context_limits_are_refused_not_clamped_as_documented(server):
    """A prompt with no room for a token, or a max_tokens past the context, is refused with
    context_length_exceeded; a max_tokens left out is the default (16) or the room left."""
    url = f"{server.url}{COMPLETIONS}"
    full = [10 + i % 400 for i in range(MAX_MODEL_LEN)]  # ids within the vocabulary
    error = assert_error_body(httpx.post(url, json={"prompt": full}, timeout=30), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    prompt = full[:-10]  # room for exactly 10 tokens
    body = {"prompt": prompt, "max_tokens": 11, "ignore_eos": True}
    error = assert_error_body(httpx.post(url, json=body, timeout=30), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]
    fits = httpx.post(url, json={**body, "max_tokens": 10}, timeout=WAIT_S).json()
    assert fits["usage"]["completion_tokens"] == 10
    left_out = httpx.post(url, json={"prompt": full[:-1], "ignore_eos": True}, timeout=WAIT_S)
    assert left_out.json()["usage"]["completion_tokens"] == 1
    assert left_out.json()["choices"][0]["finish_reason"] == "length"
    server.wait_until_idle()


def test_unknown_fields_are_accepted_and_ignored(server):
    extra = {"user": "u-1", "frobnicate": {"deep": [1, 2]}, "guided_json": None}
    r = httpx.post(
        f"{server.url}{COMPLETIONS}",
        json={"prompt": "Hi", "max_tokens": 2, **extra},
        timeout=WAIT_S,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    r = httpx.post(
        f"{server.url}{CHAT}", json={"messages": HI, "max_tokens": 2, **extra}, timeout=WAIT_S
    )
    assert r.status_code == 200
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hi", **extra})
    assert r.status_code == 200


def test_unknown_fields_are_named_in_a_debug_line(caplog):
    from pdserve.coordinator.openai_protocol import CompletionRequest, parse_body

    with caplog.at_level(logging.DEBUG, logger="pdserve.coordinator.openai_protocol"):
        body = parse_body(b'{"prompt": "hi", "user": "u", "zzz": 1}', CompletionRequest)
    assert body.prompt == "hi"
    assert "ignored unknown fields user, zzz" in caplog.text


def test_overload_is_refused_whole_with_retry_after(server):
    url = f"{server.url}/v1/completions"
    body = {"prompt": "hello", "max_tokens": 4, "n": 8}

    def post_with(status: int) -> httpx.Response | None:
        r = httpx.post(url, json=body, timeout=30)
        return r if r.status_code == status else None

    server.reload(max_pending=2)
    try:
        r = wait_until(lambda: post_with(429), "the reloaded limit (2 pending) to refuse n=8")
        error = assert_error_body(r, 429, None)
        assert error["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
        assert httpx.post(url, json={**body, "n": 2}, timeout=30).status_code == 200
    finally:
        server.reload(max_pending=512)
    wait_until(lambda: post_with(200), "the restored limit (512 pending) to accept n=8")
    server.wait_until_idle()


# --- disconnects -------------------------------------------------------------------------------


# The client leaves once the request is seen decoding with its blocks (polled every 20 ms, seen
# within ~0.1 s of the nodes' heartbeats), never after a fixed time; each request fills the
# 2,048-token context, about 1 s of decoding on an idle machine, so it outlasts that probe by
# ten times or more. A slow machine only makes both slower; the deadline is WAIT_S.


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.metrics().get(ABORTED, 0)
    body = {
        "prompt": list(range(10, 130)),
        "max_tokens": 1900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
        assert next(lines).startswith("data: {")
        wait_until(server.decoding_with_blocks, "the request to hold KV blocks", poll_s=0.02)
    # Leaving the block closed the connection mid-stream.
    server.wait_until_idle()
    assert server.metrics()[ABORTED] == before + 1


def test_client_disconnect_during_a_non_streamed_request_aborts_it(server):
    before = server.metrics().get(ABORTED, 0)
    body = json.dumps(
        {"prompt": "a long one", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    ).encode()
    # A bare socket: the client is gone exactly when the test closes it.
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until(server.decoding_with_blocks, "the request to hold KV blocks", poll_s=0.02)
    server.wait_until_idle()
    assert server.metrics()[ABORTED] == before + 1


# --- what operators watch ----------------------------------------------------------------------

GRAFANA = REPO / "deploy" / "grafana" / "pdserve.json"
# What the dashboard must chart, by the metrics it reads.
CHARTED = {
    "TTFT": "pdserve_time_to_first_token_seconds_bucket",
    "TPOT": "pdserve_time_per_output_token_seconds_bucket",
    "throughput": "pdserve_generation_tokens_total",
    "KV usage per node": "pdserve_kv_blocks_free",
    "queue": "pdserve_requests_waiting",
    "transfers": "pdserve_kv_handoff_seconds_bucket",
}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def test_the_grafana_dashboard_charts_only_metrics_the_server_serves(server):
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr)}
    for what, name in CHARTED.items():
        assert name in used, f"the dashboard charts no {what} ({name})"
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    served = {f.name + suffix for f in families for suffix in SUFFIXES.get(f.type, ("",))}
    assert used <= served, f"charted but not served: {sorted(used - served)}"
    # A request went through a KV handoff by now: the transfers panel has data.
    assert server.metrics()["pdserve_kv_handoff_seconds_count"] >= 1


def test_the_coordinator_logs_a_stats_line_while_requests_run(server):
    body = {"prompt": "stats", "max_tokens": 64, "ignore_eos": True}
    assert httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=WAIT_S).status_code == 200

    def stats_line() -> str | None:
        lines = [x for x in server.log.read_text().splitlines() if "pdserve.stats" in x]
        return lines[-1] if lines else None

    # Every 10 s while anything runs; earlier tests kept it busy for longer than that.
    line = wait_until(stats_line, "a stats line in the coordinator's log")
    for words in (
        "prompt throughput",
        "generation throughput",
        "running",
        "waiting",
        "KV cache usage prefill",
        "decode",
        "prefix cache hit rate",
    ):
        assert words in line, line


def test_sigterm_lets_a_stream_finish_then_stops_with_no_traceback(server):
    """Last: it stops the module's server. The stream outlasts the signal by far (300 tokens
    against the first one); the drain lets it end."""
    body = {"prompt": "last", "max_tokens": 300, "ignore_eos": True, "stream": True}
    reasons = []
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=WAIT_S) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if not reasons:
                server.proc.send_signal(signal.SIGTERM)
            reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
    assert reasons[-1] == "length"
    assert server.proc.wait(WAIT_S) == 0
    log = server.log.read_text()
    for bad in ("Traceback", "exception was never retrieved", "Host unreachable"):
        assert bad not in log, bad
