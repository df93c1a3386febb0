"""Where a served system's CPU goes (`pdserve.bench.serving.cpu_use`): a py-spy sample's kind of
work from its frames, a process's role from its command line, and a measurement of a real
process: its CPU time from /proc and the split of its samples."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.bench.serving.cpu_use import (
    FORWARD,
    OTHER,
    CPUUse,
    classify,
    kind_ms_per_token,
    role,
    split_samples,
)

LOOP = ["<module> (pdserve/__main__.py:5)", "run (cluster/node_loop.py:153)"]


def test_a_sample_inside_the_models_forward_is_forward_whatever_it_calls():
    frames = [
        *LOOP,
        "run_plan (engine/execution/runner.py:105)",
        "forward (engine/models/llama.py:202)",
    ]
    assert classify([*frames, "__call__ (torch/_ops.py:1)"]) == FORWARD
    assert classify([*frames, "paged_attention (kernels/paged_attention_cpu.py:9)"]) == FORWARD
    # The same kernel outside the model (the runner preparing a step) is not.
    runner = [*LOOP, "run_plan (engine/execution/runner.py:105)"]
    assert classify([*runner, "_token_positions (kernels/paged_attention_cpu.py:9)"]) == (
        "step preparation"
    )


def test_the_first_kind_with_a_frame_in_the_stack_wins():
    report = [*LOOP, "report (decode_node/worker.py:1)", "send (cluster/node_link.py:2)"]
    assert classify([*report, "send_multipart (zmq/sugar/socket.py:3)"]) == "node messages"
    # A tokenizer's decode called by the coordinator's detokenizer is detokenizing.
    detok = ["stream (coordinator/serving_completion.py:1)", "step (coordinator/detokenizer.py:2)"]
    assert classify([*detok, "decode (engine/tokenizer.py:3)"]) == "detokenize"
    assert (
        classify(["serve (coordinator/serving_completion.py:1)", "encode (engine/tokenizer.py:2)"])
        == "tokenize"
    )
    sse = [
        "run (uvicorn/server.py:1)",
        "send (h11/_connection.py:2)",
        "write (asyncio/selector_events.py:3)",
    ]
    assert classify(sse) == "HTTP and SSE"
    assert classify([*LOOP, "log (logging/__init__.py:1)", "send (zmq/sugar/socket.py:1)"]) == (
        "logging and metrics"
    )
    assert classify(LOOP) == OTHER
    # vLLM's engine core: its loop is other, its scheduler scheduling, its model forward.
    core = ["run_busy_loop (vllm/v1/engine/core.py:1)"]
    assert classify(core) == OTHER
    assert classify([*core, "schedule (vllm/v1/core/sched/scheduler.py:2)"]) == "scheduling"
    assert (
        classify([*core, "forward (/x/site-packages/vllm/model_executor/models/llama.py:3)"])
        == FORWARD
    )


def test_samples_are_counted_per_kind_from_pyspy_raw_lines():
    raw = (
        ";".join([*LOOP, "forward (engine/models/llama.py:1)"]) + " 7\n"
        + ";".join(LOOP) + " 2\n"
        + ";".join([*LOOP, "send (zmq/sugar/socket.py:1)"]) + " 3\n"
        + "\n"
    )  # fmt: skip
    assert split_samples(raw) == {FORWARD: 7, OTHER: 2, "node messages": 3}


def test_roles_come_from_process_titles_and_command_lines():
    assert role("pdserve-serve") == "coordinator"
    assert role("pdserve-decode-0") == "decode-0"
    assert role("pdserve-tp-rank1") == "tp-rank1"
    assert role("VLLM::EngineCore") == "vLLM EngineCore"
    assert (
        role("/v/bin/python -m vllm.entrypoints.openai.api_server --model m") == "vLLM API server"
    )


def test_a_roles_cpu_splits_as_its_samples_with_zeromq_threads_apart():
    r = {"cpu_s": 2.0, "zmq_s": 0.5, "ms_per_token": 4.0, "samples": {FORWARD: 60, OTHER: 20}}
    split = kind_ms_per_token(r)
    assert split["ZeroMQ I/O threads"] == pytest.approx(1.0)  # a quarter of the CPU
    assert split[FORWARD] == pytest.approx(2.25) and split[OTHER] == pytest.approx(0.75)
    assert kind_ms_per_token({**r, "samples": {}}) == {}


BURN = """
import time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        sum(range(1000))
"""
MAIN = """
import sys
from engine.models.burn import burn
sys.stdout.write("ready\\n"); sys.stdout.flush()
burn(30)
"""


def test_a_measurement_of_a_real_process_gives_its_cpu_and_its_samples_kind(tmp_path):
    # A process whose only work is a loop in a file the split reads as the model's forward.
    models = tmp_path / "engine" / "models"
    models.mkdir(parents=True)
    (models / "burn.py").write_text(BURN)
    (tmp_path / "main.py").write_text(MAIN)
    # Its `engine` package is tmp_path's (a PYTHONPATH naming pdserve's checkout would win).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [sys.executable, "main.py"], stdout=subprocess.PIPE, cwd=tmp_path, text=True, env=env
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        use = CPUUse(proc.pid, tmp_path / "samples", sample_rate_hz=100, label="t")
        use.begin()
        time.sleep(2.0)
        out = use.end(tokens=1000)
    finally:
        proc.kill()
        proc.wait()
    ((name, r),) = out["roles"].items()
    assert name == "python3" or name.startswith("python")
    assert r["cpu_s"] > 0.2  # it ran, on one of the machine's cores, for most of 2 s
    assert r["ms_per_token"] == pytest.approx(r["cpu_s"])  # 1000 tokens: s -> ms
    samples = sum(r["samples"].values())
    assert samples > 20 and r["samples"].get(FORWARD, 0) >= 0.8 * samples, r["samples"]
    assert out["wall_s"] >= 2.0 and out["machine_cpu_s"] >= r["cpu_s"] * 0.9
