"""Ctrl-C on `pdserve serve` while requests run: every open stream ends at once with a
`server_shutdown` error event and `[DONE]`, a whole response under way gets a 503, each request
is aborted on its nodes and logged once as cut, and the process exits 0 with no traceback."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess
from waiting import WAIT_S, wait_until

pytestmark = pytest.mark.cluster

MAX_MODEL_LEN = 2040
# Far more tokens than arrive between the first chunks and the signal, however quiet the
# machine: the stream must still be running when serve is stopped.
MAX_TOKENS = 2000
# "At once": well under uvicorn's grace period plus the time it took to cut a stream before.
CUT_WITHIN_S = 10.0


def completion(stream: bool) -> dict:
    return {
        "prompt": "the quick brown fox",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def test_ctrl_c_cuts_open_requests_with_an_error_and_exits_cleanly(tmp_path: Path):
    serve = ServeProcess(["pdserve-tiny", "--max-model-len", str(MAX_MODEL_LEN)], tmp_path / "log")
    try:
        serve.wait_healthy()
        whole: list[httpx.Response] = []

        def post_whole() -> None:
            whole.append(
                httpx.post(f"{serve.url}/v1/completions", json=completion(False), timeout=WAIT_S)
            )

        waiter = threading.Thread(target=post_whole)
        waiter.start()
        events: list[str] = []
        with httpx.stream(
            "POST", f"{serve.url}/v1/completions", json=completion(True), timeout=WAIT_S
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while len(events) < 3:
                line = next(lines)
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
            # Both requests run on the nodes before the signal.
            wait_until(lambda: serve.output().count("submitted 1 choice(s)") >= 2, "both submits")
            serve.proc.send_signal(signal.SIGINT)  # Ctrl-C
            signalled = time.monotonic()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
            ended_after_s = time.monotonic() - signalled
        waiter.join(WAIT_S)
        assert serve.proc.wait(60) == 0
    finally:
        serve.stop()
    console = serve.output()

    assert ended_after_s < CUT_WITHIN_S, console[-3000:]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_shutdown" and error["code"] == "server_shutdown"
    assert error["message"] == "the server is shutting down"
    streamed = [json.loads(e) for e in events[:-2]]
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in streamed)

    (response,) = whole
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_shutdown"

    # One cut line per request, naming it and what it had streamed; each aborted on its nodes.
    cuts = re.findall(r"\[(\S+)\] cut by shutdown after (\d+) tokens streamed", console)
    assert len(cuts) == 2, console[-3000:]
    for request_id, tokens in cuts:
        assert 0 < int(tokens) < MAX_TOKENS
        assert f"[{request_id}] ended by the frontend (abort)" in console
    stream_id = json.loads(events[0])["id"]
    assert f"{stream_id}-0" in {request_id for request_id, _ in cuts}
    assert "Traceback" not in console and "CancelledError" not in console, console[-3000:]
