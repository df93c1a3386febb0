"""The HTTP API's defences for real: `pdserve serve` with API keys (a decode node it starts, and a
prefill node this test starts and can pause) refuses a client without a key with 401 before the
model runs; the official `openai` client with `api_key=` is served; bodies, n, best_of, stop
strings, logit_bias and logprobs are bounded (413 / 400 with an OpenAI error body, nothing held);
the coordinator never holds more than max_pending_requests requests nor max_pending_tokens prompt
tokens; and schemathesis, fed the served /openapi.json, finds no server error in a few hundred
generated requests per operation, every KV block free afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess
from test_http_api import assert_error_body
from waiting import WAIT_S, wait_until

from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.tune.local_server import free_port

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
KEY, OTHER_KEY = "sesame-open", "second-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 32  # every generation is short, whatever max_tokens and n the fuzzer picks
BODY_LIMIT = 64 << 10
# The prefill node is paused by one test: the coordinator must not declare it dead meanwhile.
CONFIG = """
num_kv_blocks = 128
block_size = 8
heartbeat_interval_s = 0.05
heartbeat_timeout_s = 600
max_request_body_bytes = {body_limit}
max_n = {max_n}
max_logprobs = 5
max_stop_strings = 4
max_stop_string_chars = 16
max_logit_bias = 8
max_pending_requests = {max_pending}
max_pending_tokens = {max_tokens}
metrics_require_api_key = {metrics_keyed}
"""
COMPLETIONS, CHAT, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/messages"
HI = [{"role": "user", "content": "Hi"}]


@dataclass
class Server:
    proc: subprocess.Popen  # pdserve serve (coordinator and a decode node)
    prefill: subprocess.Popen  # a prefill node of this test's own
    port: int
    config: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name and labels (asked with the key: it may need one)."""
        text = httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def model_work(self) -> tuple[float, ...]:
        """What running the model leaves behind: prompt tokens and requests finished at the
        coordinator, prefix-cache lookups on the nodes."""
        m = self.metrics()
        return tuple(
            sum(v for k, v in m.items() if k.startswith(name))
            for name in (
                "pdserve_prompt_tokens_total",
                "pdserve_requests_finished_total",
                "pdserve_prefix_cache_hit_blocks",
                "pdserve_prefix_cache_miss_blocks",
            )
        )

    def idle(self) -> bool:
        """Every KV block free on both nodes and no request left at the coordinator."""
        m = self.metrics()
        free = sum(v for k, v in m.items() if k.startswith("pdserve_kv_blocks_free{"))
        total = sum(v for k, v in m.items() if k.startswith("pdserve_kv_blocks_total{"))
        busy = m["pdserve_requests_running"] + m["pdserve_requests_waiting"]
        return total == 256 and free == total and busy == 0

    def wait_until_idle(self) -> None:
        wait_until(self.idle, "every KV block free and no request left at the coordinator")

    def reload(self, **limits: object) -> None:
        """The config file with these limits (the others as at start), read again (SIGHUP)."""
        write_config(self.config, **limits)
        self.proc.send_signal(signal.SIGHUP)


def write_config(path: Path, **limits: object) -> None:
    values = {
        "body_limit": BODY_LIMIT,
        "max_pending": 512,
        "max_tokens": 1 << 20,
        "max_n": 4,
        "metrics_keyed": "false",
        **limits,
    }
    path.write_text(CONFIG.format(**values))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ensure_tiny_model()
    tmp = tmp_path_factory.mktemp("http-security")
    config, log = tmp / "pdserve.toml", tmp / "server.log"
    write_config(config)
    node_port = free_port()
    env = {**os.environ, "PDSERVE_API_KEY": OTHER_KEY}  # a flag wins over the variable
    args = ["pdserve-tiny", "--node-port", str(node_port), "--config", str(config)]
    args += ["--prefill-nodes", "0", "--max-model-len", str(MAX_MODEL_LEN)]
    serve = ServeProcess([*args, "--api-key", KEY, "--api-key", OTHER_KEY], log, env)
    srv = Server(serve.proc, None, serve.port, config, log)  # type: ignore[arg-type]
    try:
        serve.wait_serving()
        with open(tmp / "prefill.log", "w") as out:
            srv.prefill = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pdserve",
                    "prefill",
                    "--coordinator",
                    f"tcp://127.0.0.1:{node_port}",
                    "--node-id",
                    "prefill-0",
                    "--num-kv-blocks",
                    "128",
                    "--block-size",
                    "8",
                    "--max-model-len",
                    str(MAX_MODEL_LEN),
                    "--heartbeat-interval-s",
                    "0.05",
                ],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_until(
            lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 200,
            "the prefill node to join",
            240,
        )
        srv.wait_until_idle()
        yield srv
    finally:
        prefill = srv.prefill
        if prefill is not None and prefill.poll() is None:
            os.killpg(prefill.pid, signal.SIGCONT)  # a test may have paused it
            os.killpg(prefill.pid, signal.SIGTERM)
        serve.stop(signal.SIGTERM)
        if prefill is not None:
            try:
                prefill.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(prefill.pid, signal.SIGKILL)
                prefill.wait()
        print(log.read_text()[-3000:])


# --- API keys ---------------------------------------------------------------------------------


def test_a_client_without_the_key_gets_401_and_the_model_never_runs_for_it(server):
    body = {"prompt": list(range(10, 26)), "max_tokens": 3, "ignore_eos": True}
    chat = {"messages": HI, "max_tokens": 3}
    before = server.model_work()
    refusals = [
        (COMPLETIONS, body, {}),  # no header
        (COMPLETIONS, body, {"Authorization": "Bearer wrong"}),
        (COMPLETIONS, body, {"Authorization": f"Bearer {KEY}x"}),  # a key's extension
        (COMPLETIONS, body, {"Authorization": f"Basic {KEY}"}),  # not bearer auth
        (COMPLETIONS, body, {"Authorization": KEY}),
        (CHAT, chat, {}),
        ("/tokenize", {"prompt": "hi"}, {}),
        ("/detokenize", {"tokens": [10, 11]}, {}),
    ]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, payload, headers in refusals:
            r = http.post(path, json=payload, headers=headers)
            error = assert_error_body(r, 401, None)
            assert error["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert_error_body(http.get("/v1/models"), 401, None)
        # No body is read for a refused client, not even a large one.
        assert_error_body(http.post(COMPLETIONS, content=b"x" * (4 * BODY_LIMIT)), 401, None)
        for path in ("/health", "/version", "/metrics", "/openapi.json"):  # open by default
            assert http.get(path).status_code == 200, path
        assert server.model_work() == before  # nothing ran: no tokens, no lookups
        for key in (KEY, OTHER_KEY):  # either key of the two given
            r = http.post(COMPLETIONS, json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    after = wait_until(
        lambda: (w := server.model_work())[2] + w[3] > before[2] + before[3] and w,
        "the nodes to report the keyed requests' prefix lookups",
    )
    assert after[:2] == (before[0] + 32, before[1] + 2)  # the counters do move
    server.wait_until_idle()


def test_the_openai_client_with_api_key_is_served_and_a_wrong_key_is_its_auth_error(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(
        model="pdserve-tiny", prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 2
    chat = client.chat.completions.create(model="pdserve-tiny", messages=HI, max_tokens=2)
    assert chat.choices[0].message.role == "assistant"
    assert [m.id for m in client.models.list()] == ["pdserve-tiny"]
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model="pdserve-tiny", prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    server.wait_until_idle()


def test_the_load_generator_sends_the_api_key_it_is_given(server):
    def load(*key: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.bench.serve_load",
                "--base-url",
                server.url,
                *key,
                "--num-requests",
                "3",
                "--warmup",
                "0",
                "--short-prompt-len",
                "8",
                "--short-output-len",
                "4",
                "--no-progress",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    keyed = load("--api-key", KEY)
    assert keyed.returncode == 0 and "3/3 ok" in keyed.stdout, keyed.stdout + keyed.stderr
    refused = load()
    assert "0/3 ok" in refused.stdout and "(3 failed)" in refused.stdout, refused.stdout
    server.wait_until_idle()


def test_metrics_need_the_key_when_the_setting_says_so(server):
    def metrics_status(headers: dict[str, str]) -> int:
        return httpx.get(f"{server.url}/metrics", headers=headers, timeout=10).status_code

    server.reload(metrics_keyed="true")
    try:
        wait_until(lambda: metrics_status({}) == 401, "the reload to put /metrics behind the key")
        assert metrics_status(AUTH) == 200
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # still open
    finally:
        server.reload()
    wait_until(lambda: metrics_status({}) == 200, "the reload to open /metrics again")


# --- bounded inputs ---------------------------------------------------------------------------


def test_an_oversized_body_gets_413_with_an_error_body_declared_or_streamed(server):
    before = server.model_work()
    big = {"prompt": "hello " * (BODY_LIMIT // 6 + 10), "max_tokens": 1}
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
        error = assert_error_body(http.post(COMPLETIONS, json=big), 413, None)
        assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]
        raw = json.dumps(big).encode()

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for lo in range(0, len(raw), 4096):
                yield raw[lo : lo + 4096]

        r = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert_error_body(r, 413, None)
        # Just under the limit is read and served.
        fits = {"prompt": [10] * 8, "max_tokens": 1, "pad": "x" * (BODY_LIMIT - 200)}
        assert http.post(COMPLETIONS, json=fits).status_code == 200
    server.wait_until_idle()
    assert server.model_work()[1] == before[1] + 1  # only the one that fit ran


BOUNDS = [
    (COMPLETIONS, {"n": 5}, "n"),
    (COMPLETIONS, {"n": 4, "best_of": 5}, "best_of"),
    (COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (COMPLETIONS, {"stop": "x" * 17}, "stop"),
    (COMPLETIONS, {"logit_bias": {str(i): 1.0 for i in range(9)}}, "logit_bias"),
    (COMPLETIONS, {"logprobs": 6}, "logprobs"),
    (CHAT, {"n": 5}, "n"),
    (CHAT, {"stop": [str(i) for i in range(5)]}, "stop"),
    (CHAT, {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
]
AT_THE_BOUNDS = [
    (COMPLETIONS, {"n": 4, "best_of": 4, "stop": ["a" * 16, "b", "c", "d"], "logprobs": 5}),
    (CHAT, {"n": 4, "stop": ["a", "b", "c", "d" * 16], "logprobs": True, "top_logprobs": 5}),
]


def test_bounds_on_n_best_of_stop_logit_bias_and_logprobs_answer_400_and_hold_nothing(server):
    base = {COMPLETIONS: {"prompt": "Hi", "max_tokens": 2}, CHAT: {"messages": HI, "max_tokens": 2}}
    before = server.model_work()
    with httpx.Client(base_url=server.url, timeout=WAIT_S, headers=AUTH) as http:
        for path, extra, param in BOUNDS:
            error = assert_error_body(http.post(path, json={**base[path], **extra}), 400, param)
            assert "at most" in error["message"], error
        assert server.model_work() == before
        for path, extra in AT_THE_BOUNDS:  # the bounds themselves are allowed
            r = http.post(path, json={**base[path], **extra})
            assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    server.wait_until_idle()


def test_the_coordinator_holds_at_most_max_pending_requests_and_tokens(server):
    """With the prefill node paused, a request stays pending at the coordinator; requests that
    would take the pending count or prompt tokens past their bounds are refused whole (429), one
    larger than the token bound alone is invalid (400); after the node resumes, only the one
    admitted ran and every block is free."""
    url = f"{server.url}{COMPLETIONS}"
    tokens = [10 + i for i in range(10)]

    def phase(name: str) -> float:
        return server.metrics()[f'pdserve_requests_phase{{phase="{name}"}}']

    def post(prompt: list[int], n: int = 1) -> httpx.Response:
        body = {"prompt": prompt, "n": n, "max_tokens": 2, "ignore_eos": True}
        return httpx.post(url, json=body, headers=AUTH, timeout=120)

    server.reload(max_pending=2, max_tokens=16)
    wait_until(
        lambda: post(tokens * 2).status_code == 400,
        "the reloaded token bound (16) to refuse a 20-token prompt",
    )
    server.wait_until_idle()  # (what ran before the reload was read)
    before = server.model_work()
    os.kill(server.prefill.pid, signal.SIGSTOP)
    pool = ThreadPoolExecutor(1)
    try:
        held = pool.submit(post, tokens)  # 10 tokens, pending while the node is paused
        wait_until(lambda: phase("prefilling") == 1, "the request to wait on the paused node")
        for prompt, n in ((tokens[:7], 1), (tokens[:3], 2)):  # 17 > 16 tokens; 3 > 2 requests
            r = post(prompt, n)
            error = assert_error_body(r, 429, None)
            assert error["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1
        error = assert_error_body(post(tokens + tokens[:7]), 400, None)  # 17 > 16 alone
        assert "max_pending_tokens" in error["message"]
        assert phase("prefilling") == 1  # none of them was taken in
    finally:
        os.kill(server.prefill.pid, signal.SIGCONT)
        done = held.result(timeout=120)
        pool.shutdown()
        server.reload()
    assert done.status_code == 200 and done.json()["usage"]["prompt_tokens"] == 10
    server.wait_until_idle()
    after = server.model_work()
    assert after[:2] == (before[0] + 10, before[1] + 1), (before, after)


# --- schema fuzzing ---------------------------------------------------------------------------

# Requests generated per operation that takes a body: valid ones by the schema, and half as many
# that break it; a route with no inputs has few distinct requests to make.
FUZZ_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "130"))
NO_INPUT_EXAMPLES = 10


def check_answer(method: str, path: str, response: httpx.Response) -> None:
    """No server error; an error is an OpenAI error body (Anthropic's on the Messages API's
    paths); a success is what the route promises."""
    assert response.status_code < 500, response.text
    kind = response.headers.get("content-type", "")
    if response.status_code >= 400:
        assert kind.startswith("application/json"), kind
        if path.startswith(MESSAGES):
            body = response.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            assert body["error"]["type"] and body["error"]["message"]
            return
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    if path == "/metrics":
        assert "pdserve_kv_blocks_free" in response.text
        return
    if kind.startswith("text/event-stream") and path == MESSAGES:
        events = [
            json.loads(line[6:]) for line in response.text.splitlines() if line[:6] == "data: "
        ]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        return
    if kind.startswith("text/event-stream") and path == "/v1/responses":
        # The Responses API's stream has no [DONE]: it ends with the response's final event.
        events = [
            json.loads(line[6:]) for line in response.text.splitlines() if line[:6] == "data: "
        ]
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        return
    if kind.startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and all("choices" in c for c in chunks)
        return
    assert kind.startswith("application/json"), kind
    data = response.json()
    if path in (COMPLETIONS, CHAT):
        assert data["choices"] and data["usage"]["completion_tokens"] >= 0
        for choice in data["choices"]:
            assert choice["finish_reason"] in ("stop", "length")
            text = choice["text"] if path == COMPLETIONS else choice["message"]["content"]
            assert isinstance(text, str)
    elif path == MESSAGES:
        assert data["type"] == "message" and data["usage"]["output_tokens"] >= 0
        assert data["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    elif path == f"{MESSAGES}/count_tokens":
        assert data["input_tokens"] > 0
    elif path == "/tokenize":
        assert data["count"] == len(data["tokens"])
    elif path == "/detokenize":
        assert isinstance(data["prompt"], str)


@pytest.mark.timeout(600)
def test_schema_fuzzing_finds_no_server_error_and_leaves_every_block_free(server):
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {f"{op.method.upper()} {op.path}" for op in operations}
    assert labels >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
        "POST /tokenize",
        "POST /detokenize",
        "GET /v1/models",
        "GET /health",
        "GET /metrics",
        "GET /version",
    }
    counts = dict.fromkeys(labels, 0)
    # n = 2 at most: the generated requests that run stay cheap (more is refused, and tested).
    server.reload(max_n=2)
    wait_until(
        lambda: (
            httpx.post(
                f"{server.url}{COMPLETIONS}",
                headers=AUTH,
                timeout=WAIT_S,
                json={"prompt": "Hi", "n": 3},
            ).status_code
            == 400
        ),
        "the reload to lower max_n",
    )
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=WAIT_S, headers=AUTH) as http:
        for op in operations:
            modes = [(schemathesis.GenerationMode.POSITIVE, NO_INPUT_EXAMPLES)]
            if op.body:
                modes = [
                    (schemathesis.GenerationMode.POSITIVE, FUZZ_EXAMPLES),
                    (schemathesis.GenerationMode.NEGATIVE, FUZZ_EXAMPLES // 2),
                ]
            for mode, examples in modes:
                fuzz(op, mode, examples, http, server.url, counts)
    print(f"fuzzed {sum(counts.values())} requests in {time.monotonic() - started:.0f} s: {counts}")
    # Every operation with a body got its share (hypothesis stops early only when it runs out).
    assert all(n >= 1.4 * FUZZ_EXAMPLES for k, n in counts.items() if k.startswith("POST")), counts
    server.reload()
    server.wait_until_idle()


def fuzz(op, mode, examples: int, http: httpx.Client, url: str, counts: dict[str, int]) -> None:  # noqa: ANN001
    """Send `examples` requests that schemathesis generates for one operation (positive: valid by
    the schema; negative: not) and check every answer."""
    import hypothesis
    from hypothesis import HealthCheck, Phase

    label = f"{op.method.upper()} {op.path}"

    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=op.as_strategy(generation_mode=mode).map(served_model))
    def run(case) -> None:  # noqa: ANN001
        kwargs = case.as_transport_kwargs(base_url=url)
        headers = {**kwargs.get("headers", {}), **AUTH}
        response = http.request(
            kwargs["method"],
            kwargs["url"],
            headers=headers,
            content=_content(kwargs),
            params=kwargs.get("params"),
        )
        check_answer(case.method, case.path, response)
        counts[label] += 1

    run()


def served_model(case):  # noqa: ANN001, ANN201
    """A generated body names the served model where it names one, so that valid requests run
    the model instead of stopping at a 404 (which the negative cases and other tests cover)."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "pdserve-tiny"
    return case


def _content(kwargs: dict) -> bytes | None:
    """The body schemathesis made, as bytes (it may be JSON of any value, or raw)."""
    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data") or kwargs.get("content")
    if isinstance(data, str):
        return data.encode()
    return data
