"""The fault layer alone: what PDSERVE_FAULTS reads and refuses, and what each message fault
does to the messages one socket receives."""

from __future__ import annotations

import pytest
import zmq

from pdserve.cluster.faults import FaultPlan, MessageFaults, message_faults


def faults(kind: str, **extra: float) -> MessageFaults:
    return MessageFaults(FaultPlan(rates={kind: 1.0}, **extra), "test")


def test_the_plan_reads_rates_seed_and_durations_and_refuses_what_it_cannot_read():
    plan = FaultPlan.parse("drop=0.02, kill=0.001,seed=7,delay_ms=80")
    assert plan.rates == {"drop": 0.02, "kill": 0.001}
    assert (plan.seed, plan.delay_ms, plan.stall_ms) == (7, 80.0, 1000.0)
    for text in ("drop=2", "drop=x", "lose=0.1", "seed=a", "delay_ms=-1", "drop=0.6,corrupt=0.6"):
        with pytest.raises(ValueError, match="PDSERVE_FAULTS"):
            FaultPlan.parse(text)


def test_no_faults_unless_configured(monkeypatch):
    monkeypatch.delenv("PDSERVE_FAULTS", raising=False)
    assert message_faults("x") is None
    monkeypatch.setenv("PDSERVE_FAULTS", "kill=0.1")  # a process fault only
    assert message_faults("x") is None
    monkeypatch.setenv("PDSERVE_FAULTS", "reorder=0.1")
    assert message_faults("x") is not None


def test_each_message_fault():
    m = [b"id", b"header", b"body"]
    assert faults("drop").arrive(m, skip=1) == []
    assert faults("duplicate").arrive(m, skip=1) == [m, m]
    delay = faults("delay", delay_ms=50)
    assert delay.arrive(m, now=1.0) == [] and delay.due(1.04) == [] and delay.due(1.05) == [m]
    (cut,) = faults("truncate").arrive(m, skip=1)
    assert cut[:2] == m[:2] and len(cut[2]) < len(m[2]) and m[2].startswith(cut[2])
    (changed,) = faults("corrupt").arrive(m, skip=1)
    assert changed[0] == b"id" and changed != m
    assert sum(bin(x ^ y).count("1") for x, y in zip(b"".join(changed), b"".join(m))) == 1


def test_a_reordered_message_comes_after_the_next_one_or_after_its_delay():
    plan = FaultPlan(rates={"reorder": 0.5}, seed=1, delay_ms=50)
    f = MessageFaults(plan, "test")
    out = []
    for i in range(200):
        out += f.arrive([str(i).encode()], now=float(i))
    out += f.due(1e9)
    order = [int(m[0]) for m in out]
    assert sorted(order) == list(range(200)) and order != list(range(200))
    assert all(abs(i - at) <= 1 for at, i in enumerate(order))  # one place, no more
    lone = MessageFaults(FaultPlan(rates={"reorder": 1.0}, delay_ms=50), "lone")
    assert lone.arrive([b"m"], now=0.0) == [] and lone.due(0.05) == [[b"m"]]


def test_a_changed_zmq_frame_stays_a_frame():
    (changed,) = faults("corrupt").arrive([zmq.Frame(b"id"), zmq.Frame(b"body")], skip=1)
    assert isinstance(changed[1], zmq.Frame) and changed[1].bytes != b"body"


def test_the_same_seed_and_name_give_the_same_faults():
    plan = FaultPlan.parse("drop=0.3,duplicate=0.3,seed=5")
    runs = [[len(MessageFaults(plan, "s").arrive([b"m"])) for _ in range(50)] for _ in range(2)]
    assert runs[0] == runs[1]
