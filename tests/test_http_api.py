"""The OpenAI-compatible HTTP API for real: `pdserve serve` as a subprocess (1 prefill + 1 decode
node on pdserve-tiny), driven by the official `openai` package and httpx."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parent.parent
# Heartbeats often, so a request's KV blocks show in /metrics soon after it starts decoding.
CONFIG = """
num_kv_blocks = 256
block_size = 8
heartbeat_interval_s = 0.05
max_pending_requests = {max_pending}
"""
WORDS = ("the quick brown fox jumps over lazy dog hello world prefill decode worker model "
         "token cache page paris france small time").split()  # fmt: skip
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
# Deadlines for what must happen, not estimates of when: two shared cores can stall for seconds.
WAIT_S = 60.0
ABORTED = 'pdserve_requests_finished_total{finish_reason="abort"}'

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None], what: str, timeout_s: float = WAIT_S, poll_s: float = 0.05
) -> T:
    """Polls `condition` until it returns something other than None or False, and returns that;
    fails naming `what` if `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while (result := condition()) is None or result is False:
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(poll_s)
    return result


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    ensure_tiny_model()  # once here, not raced by the nodes
    tmp = tmp_path_factory.mktemp("http")
    config, log = tmp / "pdserve.toml", tmp / "server.log"
    config.write_text(CONFIG.format(max_pending=512))
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", "--port", str(port), "--config", str(config)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )  # fmt: skip
    srv = Server(proc, port, config, log)

    def healthy() -> bool:
        assert proc.poll() is None, f"pdserve serve exited:\n{log.read_text()[-4000:]}"
        try:
            return httpx.get(f"{srv.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, "/health to answer 200 (the log is printed below)", timeout_s=240)
        yield srv
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
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


def test_models_and_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["pdserve-tiny"]


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
            model="pdserve-tiny", prompt="Hello, world", max_tokens=24, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_every_streamed_chunk_is_valid_utf8_json(server):
    # Token ids as the prompt; the raw bytes of the stream, strictly decoded.
    body = {"prompt": [5, 200, 301, 77], "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
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
        model="pdserve-tiny", messages=messages, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_choices_are_seeded_and_indexed(server):
    client = server.client()
    kwargs = dict(model="pdserve-tiny", prompt="Once upon a time", max_tokens=12, n=3, seed=11,
                  temperature=1.0, extra_body={"ignore_eos": True})  # fmt: skip
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
        model="pdserve-tiny", messages=[{"role": "user", "content": "hello"}], n=2,
        max_tokens=8, seed=3, temperature=1.0,
    )  # fmt: skip
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
        model="pdserve-tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=10,
        logprobs=True, top_logprobs=2, **GREEDY,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 for c in content)
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content
    streamed = list(
        client.chat.completions.create(
            model="pdserve-tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=10,
            logprobs=True, top_logprobs=2, stream=True, **GREEDY,
        )
    )  # fmt: skip
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]  # fmt: skip
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
    body = {"prompt": list(range(10, 130)), "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
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
