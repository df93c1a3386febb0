"""The coordinator kill for `pdserve.bench.recovery`: `pdserve launch` of a one-host CPU cluster
file, streams over HTTP that a SIGKILL of the coordinator cuts and the client resubmits, until the
restarted coordinator serves them again."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.process_tree import Sessions, children
from pdserve.bench.recovery_record import (
    MIN_OUTPUTS,
    POLL_S,
    Kill,
    RequestOutcome,
    Workload,
    check_tokens,
    describe_kill,
)
from pdserve.coordinator.detokenizer import TokenVocabulary
from pdserve.engine.config import EngineConfig
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.tokenizer import Tokenizer
from pdserve.supervisor import Supervisor
from pdserve.tune.local_server import free_port

CLUSTER_FILE = """\
model = "{model}"
block_size = {block_size}
log_dir = "{log_dir}"
transport = "{transport}"

[coordinator]
http_port = {http_port}
node_port = {node_port}

[[host]]
name = "local"
address = "127.0.0.1"
prefill_workers = 1
decode_workers = 1
kv_port_base = {kv_port}

[host.prefill]
kv_cache_bytes = {kv_cache_bytes}
[host.decode]
kv_cache_bytes = {kv_cache_bytes}
"""


def supervisor_defaults() -> dict:
    """The restart policy `pdserve launch` gives its Supervisor: its own defaults."""
    return {
        name: p.default
        for name, p in inspect.signature(Supervisor.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


RESTART_LINE = re.compile(r"pdserve-coordinator died \(-?\d+\); restarting in ([\d.]+)s")


class LaunchedCluster:
    """`pdserve launch` of a one-host CPU cluster file (1 prefill + 1 decode worker), in a
    session of its own."""

    def __init__(
        self, work_dir: Path, model: str, engine: EngineConfig, transport: str, sessions: Sessions
    ) -> None:
        self.work_dir = work_dir
        self.sessions = sessions
        self.http_port = free_port()
        self.path = work_dir / "cluster.toml"
        self.console = work_dir / "console.txt"
        model_dir = resolve_model_dir(model)
        self.path.write_text(
            CLUSTER_FILE.format(
                model=model if model in ("pdserve-stories", "pdserve-tiny") else model_dir,
                block_size=engine.block_size,
                log_dir=work_dir / "logs",
                transport=transport,
                http_port=self.http_port,
                node_port=free_port(),
                kv_port=free_port(),
                kv_cache_bytes=engine.kv_cache_bytes or 1 << 30,
            )
        )
        self.proc: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "pdserve", "launch", str(self.path)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def __enter__(self) -> LaunchedCluster:
        with open(self.console, "w") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.sessions.add(self.proc.pid)
        try:
            self.wait_serving(300)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """SIGTERM (the coordinator drains, then every process exits), SIGKILL to the session
        if it hangs."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def console_text(self) -> str:
        return self.console.read_text(errors="replace")

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while f"pdserve: serving {self.url}" not in self.console_text():
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"pdserve launch exited; see {self.console}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdserve launch did not serve in {timeout_s:.0f} s")
            time.sleep(0.2)

    def coordinator_pid(self) -> int | None:
        assert self.proc is not None
        for pid, cmdline in children(self.proc.pid):
            if cmdline.startswith("pdserve-coordinator") or " -m pdserve coordinator" in cmdline:
                return pid
        return None

    def restart_delays(self) -> list[float]:
        """The supervisor's restart delay of each death of the coordinator, from its console."""
        return [float(m) for m in RESTART_LINE.findall(self.console_text())]


@dataclass(slots=True)
class HttpStream:
    """One streamed completion over HTTP, resubmitted from where it was cut."""

    request_id: str
    prompt: list[int]
    expected: list[int]
    tokens: list[int] = field(default_factory=list)
    cut_at: float | None = None  # when the client saw its connection cut
    first_answer_at: float | None = None  # the first HTTP answer after the cut
    resumed_at: float | None = None  # the first token of the resubmission
    error: str | None = None


async def stream_once(
    client: httpx.AsyncClient,
    model: str,
    stream: HttpStream,
    vocab: TokenVocabulary,
    on_token: Callable[[], None],
) -> str:
    """Streams prompt + the tokens so far until the end; 'done', or why it stopped: 'cut' (the
    connection), 'refused' (nothing listens, or an answer to retry later) or 'error: …'."""
    body = {
        "model": model,
        "prompt": stream.prompt + stream.tokens,
        "max_tokens": len(stream.expected) - len(stream.tokens),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,  # each token's string comes back with it: checked against the offline one
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if stream.cut_at is not None and stream.first_answer_at is None:
                stream.first_answer_at = time.monotonic()
            if response.status_code in (502, 503):
                return "refused"  # no node registered yet
            if response.status_code != 200:
                return f"error: HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    if chunk["error"].get("code") in ("unavailable", 503) and not stream.tokens:
                        return "refused"
                    return f"error: {chunk['error'].get('message')}"
                logprobs = chunk["choices"][0].get("logprobs") or {}
                for text in logprobs.get("tokens") or []:
                    index = len(stream.tokens)
                    if index >= len(stream.expected):
                        return "error: more tokens than max_tokens"
                    if text != vocab.token_str(stream.expected[index]):
                        return f"error: token {index} is {text!r}, not the offline engine's"
                    stream.tokens.append(stream.expected[index])
                    on_token()
            return "done" if len(stream.tokens) == len(stream.expected) else "cut"
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout):
        return "cut"


async def coordinator_kill_once(
    cluster: LaunchedCluster,
    repeat: int,
    workload: Workload,
    vocab: TokenVocabulary,
    timeout_s: float,
) -> Kill:
    """One kill: stream the repeat's requests, SIGKILL the coordinator once each has
    MIN_OUTPUTS tokens, and resubmit each cut stream until it is served to its end."""
    prompts = workload.prompts("coordinator", repeat)
    streams = [
        HttpStream(f"coordinator-{repeat}-{i}", p, workload.of(p)) for i, p in enumerate(prompts)
    ]
    kill = Kill("coordinator", repeat, "coordinator", [])
    killed = asyncio.Event()
    killed_at = 0.0

    async def run(client: httpx.AsyncClient, model: str, stream: HttpStream) -> None:
        deadline = time.monotonic() + timeout_s

        def on_token() -> None:
            if killed.is_set() and stream.resumed_at is None and stream.cut_at is not None:
                stream.resumed_at = time.monotonic()

        while True:
            why = await stream_once(client, model, stream, vocab, on_token)
            if why == "done" or why.startswith("error"):
                stream.error = None if why == "done" else why
                return
            if stream.cut_at is None:
                stream.cut_at = time.monotonic()
            if time.monotonic() > deadline:
                stream.error = f"not served again within {timeout_s:.0f} s ({why})"
                return
            await asyncio.sleep(0.02)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(30.0, connect=2.0)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        tasks = [asyncio.create_task(run(client, model, s)) for s in streams]
        deadline = time.monotonic() + timeout_s
        while not all(len(s.tokens) >= MIN_OUTPUTS for s in streams):
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                kill.error = "the streams never reached the kill point"
                break
            await asyncio.sleep(POLL_S)
        old = cluster.coordinator_pid()
        if old is None and kill.error is None:
            kill.error = "no coordinator process under pdserve launch"
        before = {s.request_id: len(s.tokens) for s in streams}
        if kill.error is None:
            killed_at = time.monotonic()
            os.kill(old, signal.SIGKILL)
            killed.set()
            restarted = None
            while restarted is None and time.monotonic() < killed_at + timeout_s:
                pid = cluster.coordinator_pid()
                if pid not in (None, old):
                    restarted = time.monotonic() - killed_at
                await asyncio.sleep(POLL_S)
            kill.stages["restarted_s"] = None if restarted is None else round(restarted, 4)
        await asyncio.gather(*tasks)
    answers = [s.first_answer_at - killed_at for s in streams if s.first_answer_at]
    kill.stages["http_answer_s"] = round(min(answers), 4) if answers else None
    delays = cluster.restart_delays()
    kill.stages["restart_delay_s"] = delays[-1] if delays and kill.error is None else None
    for s in streams:
        outcome = RequestOutcome(s.request_id, s.prompt, tokens=s.tokens, error=s.error)
        if kill.error is None:
            outcome.tokens_before_kill = before[s.request_id]
            outcome.affected = s.cut_at is not None
            if s.resumed_at is not None:
                outcome.recovery_s = round(s.resumed_at - killed_at, 4)
            elif outcome.affected and outcome.error is None:
                outcome.error = "cut by the kill, but no token came after it"
        check_tokens(outcome, s.expected)
        kill.requests.append(outcome)
    return kill


def coordinator_kills(
    repeats: int,
    workload: Workload,
    engine: EngineConfig,
    sessions: Sessions,
    work_dir: Path,
    timeout_s: float,
    transport: str = "tcp",
) -> list[Kill]:
    """`repeats` SIGKILLs of the coordinator under one `pdserve launch`, each once the
    coordinator has run the supervisor's stable_s (so each restart is its first backoff step)."""
    model_dir = resolve_model_dir(workload.model)
    vocab = TokenVocabulary(Tokenizer(model_dir), model_dir)
    for repeat in range(repeats):
        workload.compute(workload.prompts("coordinator", repeat), engine)
    stable_s = supervisor_defaults()["stable_s"]
    kills = []
    with LaunchedCluster(work_dir, workload.model, engine, transport, sessions) as cluster:
        started = time.monotonic()
        for repeat in range(repeats):
            # The first death meets the first backoff step whenever it comes; a later one only
            # once the restarted coordinator has run stable_s (the supervisor's count resets).
            wait = stable_s + 1 - (time.monotonic() - started)
            if repeat > 0 and wait > 0:
                print(f"coordinator #{repeat}: waiting {wait:.0f} s (stable_s)", flush=True)
                time.sleep(wait)
            kill = asyncio.run(coordinator_kill_once(cluster, repeat, workload, vocab, timeout_s))
            started = time.monotonic()  # after the restart: waiting from here errs long
            kills.append(kill)
            print(describe_kill(kill), flush=True)
    return kills
