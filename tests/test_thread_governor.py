"""Adaptive intra-op threads: the governor's decisions alone (from measured windows, no clock),
/proc/stat's idle time, and a real engine process that follows the governor and gives its threads
back at close."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.cpu.thread_governor import (
    HOLD_S,
    MAX_HOLD_S,
    WINDOW_S,
    ThreadGovernor,
    Window,
    proc_stat_idle,
)

ROOT = Path(__file__).parent.parent


def window(share: float, threads: int, idle_cores: float = 0.0) -> Window:
    """A window of 1 s of steps in which each of `threads` threads ran `share` of a core."""
    return Window(1.0, 1.0, share * threads, idle_cores)


def test_contended_threads_drop_to_one_and_quiet_ones_stay():
    gov = ThreadGovernor(2)
    assert gov.decide(window(0.98, 2), now=1.0) == 2  # each thread had its core
    assert gov.decide(window(0.5, 2), now=2.0) == 1  # each ran half the time: contended
    assert gov.threads == 1


def test_threads_that_ran_little_beside_idle_cores_were_not_descheduled():
    # One thread's work in the step (a shape compiling, Python between ops): the other core
    # sat idle, so no other process holds it.
    gov = ThreadGovernor(2)
    assert gov.decide(window(0.5, 2, idle_cores=0.95), now=1.0) == 2
    assert gov.decide(window(0.5, 2, idle_cores=0.3), now=2.0) == 1  # the idle went to others


def test_one_thread_returns_to_all_only_after_the_hold_and_with_idle_cores():
    gov = ThreadGovernor(4)
    gov.decide(window(0.4, 4), now=10.0)
    assert gov.hold_until == 10.0 + HOLD_S
    assert gov.decide(window(1.0, 1, idle_cores=3.0), now=10.5) == 1  # still held
    assert gov.decide(window(1.0, 1, idle_cores=1.0), now=20.0) == 1  # 3 cores not idle
    assert gov.decide(window(1.0, 1, idle_cores=2.5), now=20.5) == 4


def test_a_return_that_is_contended_at_once_doubles_the_hold_up_to_a_cap():
    gov = ThreadGovernor(2)
    now = 0.0
    holds = []
    for _ in range(10):
        gov.decide(window(0.5, 2), now=now)  # contended
        holds.append(gov.hold_s)
        now = gov.hold_until
        assert gov.decide(window(1.0, 1, idle_cores=1.0), now=now) == 2  # the others look free
        now += WINDOW_S  # and are taken again within a window
    assert holds[:3] == [HOLD_S, 2 * HOLD_S, 4 * HOLD_S] and holds[-1] == MAX_HOLD_S
    # Contention long after a return starts from the first hold again.
    now += 100
    gov.decide(window(0.5, 2), now=now)
    assert gov.hold_s == HOLD_S


def test_a_single_thread_engine_and_an_empty_window_change_nothing():
    assert ThreadGovernor(1).decide(window(0.1, 1), now=5.0) == 1
    assert ThreadGovernor(2).decide(Window(1.0, 0.0, 0.0, 0.0), now=5.0) == 2
    with pytest.raises(ValueError):
        ThreadGovernor(0)


def test_idle_time_of_the_given_cores_from_proc_stat():
    text = (
        "cpu  10 0 10 900 50 0 0 0 0 0\n"
        "cpu0 5 0 5 400 20 0 0 0 0 0\n"
        "cpu1 5 0 5 500 30 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    tick = os.sysconf("SC_CLK_TCK")
    assert proc_stat_idle(text, [1]) == pytest.approx(530 / tick)
    assert proc_stat_idle(text, [0, 1]) == pytest.approx(950 / tick)
    assert proc_stat_idle(text, [7]) == 0


PROBE = """
import json, sys, torch
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cpu import thread_governor
from pdserve.engine.cpu.thread_governor import Window

contended = sys.argv[1] == "contended"
# Every window says what the test wants, whatever this machine is doing.
thread_governor.CpuTimes.window = lambda self: (
    Window(1.0, 1.0, 1.0, 0.0) if contended else Window(1.0, 1.0, 2.0, 1.0)
)
torch.set_num_threads(2)
llm = LLM(cpu_threads=2, device="cpu", num_kv_blocks=64, block_size=8,
          cpu_adaptive_threads=sys.argv[2] == "on")
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
during = torch.get_num_threads()
llm.engine.close()
print(json.dumps({"tokens": len(out[0].token_ids), "during": during,
                  "after": torch.get_num_threads()}))
"""


@pytest.mark.parametrize(
    "load, switch, during", [("contended", "on", 1), ("quiet", "on", 2), ("contended", "off", 2)]
)
def test_an_engine_follows_its_governor_and_gives_the_threads_back(load, switch, during):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, load, switch],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"tokens": 4, "during": during, "after": 2}
