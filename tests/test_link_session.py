"""Link sessions alone: every message arrives once and in order through a link that loses,
delays, repeats, reorders, cuts and changes messages (the injected faults of cluster/faults.py,
at rates far above any chaos run's); a restarted peer starts afresh; headers are checked."""

from __future__ import annotations

import pytest

from pdserve.cluster.codec import ProtocolError
from pdserve.cluster.faults import FaultPlan, MessageFaults
from pdserve.cluster.link_session import HEADER_BYTES, LinkSession


def deliver(side: LinkSession, frames: list, now: float) -> list[bytes]:
    try:
        return side.unwrap(frames, now)
    except ProtocolError:
        return []  # a cut or changed message: dropped, and sent again


def pump(a: LinkSession, b: LinkSession, to_b: list[bytes], to_a: list[bytes], plan: str):
    """Send to_b from a and to_a from b over a faulty link, stepping a clock until both sides
    have everything; what each side handed on."""
    faults_ab = MessageFaults(FaultPlan.parse(plan), "a->b")
    faults_ba = MessageFaults(FaultPlan.parse(plan), "b->a")
    got_a: list[bytes] = []
    got_b: list[bytes] = []
    wire_ab = [a.wrap(m, 0.0) for m in to_b]
    wire_ba = [b.wrap(m, 0.0) for m in to_a]
    now = 0.0
    for _ in range(2000):
        now += 0.05
        for frames in wire_ab:
            for arrived in faults_ab.arrive(frames, now=now):
                got_b += deliver(b, arrived, now)
        for frames in wire_ba:
            for arrived in faults_ba.arrive(frames, now=now):
                got_a += deliver(a, arrived, now)
        for frames in faults_ab.due(now):  # what a delay held back
            got_b += deliver(b, frames, now)
        for frames in faults_ba.due(now):
            got_a += deliver(a, frames, now)
        wire_ab, wire_ba = a.due(now), b.due(now)
        if len(got_b) == len(to_b) and len(got_a) == len(to_a) and not a.unacked and not b.unacked:
            break
    return got_a, got_b


@pytest.mark.parametrize(
    "plan",
    [
        "drop=0.3",
        "duplicate=0.3",
        "reorder=0.3",
        "delay=0.3,delay_ms=120",
        "truncate=0.2,corrupt=0.2",
        "drop=0.1,delay=0.1,duplicate=0.1,reorder=0.1,truncate=0.1,corrupt=0.1,seed=3",
    ],
)
def test_every_message_arrives_once_in_order_through_faults(plan):
    a, b = LinkSession(), LinkSession(strict=True)
    to_b = [f"order {i}".encode() for i in range(200)]
    to_a = [f"report {i}".encode() for i in range(150)]
    got_a, got_b = pump(a, b, to_b, to_a, plan)
    assert got_b == to_b
    assert got_a == to_a
    assert not a.unacked and not b.unacked  # each side heard every acknowledgement


def test_without_acknowledgements_a_message_is_sent_again_and_a_repeat_is_dropped():
    a, b = LinkSession(resend_after_s=0.3), LinkSession()
    frames = a.wrap(b"m1", 0.0)
    assert a.due(0.1) == []  # not yet
    (again,) = a.due(0.31)
    assert b.unwrap(frames, 0.3) == [b"m1"]
    assert b.unwrap(again, 0.35) == []  # a duplicate
    assert b.duplicates == 1
    (ack,) = b.due(0.4)  # nothing to send: an acknowledgement alone
    assert a.unwrap(ack, 0.4) == [] and not a.unacked


def test_a_restarted_peer_starts_afresh_and_its_old_session_is_dropped():
    coordinator = LinkSession()
    old_node = LinkSession(strict=True)
    coordinator.unwrap(old_node.wrap(b"register", 0.0), 0.0)
    order = coordinator.wrap(b"prefill r1", 0.0)  # never acknowledged: the node dies
    new_node = LinkSession(strict=True)
    assert new_node.unwrap(order, 0.1) == []  # meant for the old incarnation
    assert coordinator.unwrap(new_node.wrap(b"register again", 0.2), 0.2) == [b"register again"]
    assert not coordinator.unacked  # what was kept for the old node is given up
    late = old_node.wrap(b"tokens of the old node", 0.3)
    assert coordinator.unwrap(late, 0.3) == []  # its session is retired
    assert new_node.unwrap(coordinator.wrap(b"prefill r2", 0.4), 0.4) == [b"prefill r2"]


def test_a_new_session_starts_at_its_base():
    """What the sender gave up before its base was delivered to an earlier incarnation of this
    side (a coordinator restarted): the new one does not wait for it."""
    node = LinkSession(strict=True)
    old_coordinator = LinkSession()
    for i in range(3):
        old_coordinator.unwrap(node.wrap(f"report {i}".encode(), 0.0), 0.0)
    node.unwrap(old_coordinator.due(1.0)[0], 1.0)  # the acknowledgement of all three
    new_coordinator = LinkSession()
    assert new_coordinator.unwrap(node.wrap(b"report 3", 2.0), 2.0) == [b"report 3"]


def test_a_changed_or_short_header_is_refused():
    a = LinkSession()
    header, message = a.wrap(b"m", 0.0)
    changed = bytes([header[0] ^ 1]) + header[1:]
    for frames in ([changed, message], [header[:-1], message], [header], [header, message, b""]):
        with pytest.raises(ProtocolError):
            LinkSession().unwrap(frames, 0.0)
    assert len(header) == HEADER_BYTES
