"""A node's link to the coordinator: heartbeats keep coming while the step loop is busy."""

from __future__ import annotations

import time

import zmq

from pdserve.cluster.node_link import NodeLink
from pdserve.cluster.node_messages import Heartbeat, reports


def test_heartbeats_continue_while_the_step_loop_is_busy():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = NodeLink(f"tcp://127.0.0.1:{port}", "n0", heartbeat_interval_s=0.05)
    try:
        link.set_load(Heartbeat("n0", 16, 16, 0, 0, 0))
        time.sleep(1.0)  # one long step: the loop does not run, nothing refreshes the load
        link.close()  # stops the heartbeat thread; what it sent is queued at the router
        beats = []
        while router.poll(200):
            identity, frame = router.recv_multipart()
            beats.append((identity, reports.decode(frame)))
    finally:
        link.close()
        router.close(0)
    assert len(beats) >= 5
    assert all(identity == b"n0/heartbeat" and isinstance(m, Heartbeat) for identity, m in beats)
    assert {m.seq for _, m in beats} == {1}  # the same snapshot, resent: the node is alive
    assert beats[0][1].free_blocks == 16


def test_a_load_snapshot_counts_the_messages_its_node_had_sent_as_the_coordinator_numbers_them():
    """The fence `wait_until_idle` relies on: a snapshot's link_sent, in its link_session, is
    the count of messages the coordinator's session for that node hands on up to that point."""
    from pdserve.cluster.link_session import LinkSession
    from pdserve.cluster.node_messages import RequestError

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = NodeLink(f"tcp://127.0.0.1:{port}", "n0", heartbeat_interval_s=0.05)
    coordinator_side = LinkSession()
    try:
        link.set_load(Heartbeat("n0", 16, 16, 0, 0, 0))
        before = link._load
        for i in range(3):
            link.send(RequestError(f"r{i}", "failed"))
        link.set_load(Heartbeat("n0", 16, 16, 0, 0, 0))
        after = link._load
        handed_on = []
        while len(handed_on) < 3 and router.poll(2000):
            identity, *frames = router.recv_multipart()
            if identity == b"n0":
                handed_on += coordinator_side.unwrap(frames, time.monotonic())
    finally:
        link.close()
        router.close(0)
    assert len(handed_on) == 3
    assert before.link_sent == 0 and after.link_sent == 3 and after.seq == before.seq + 1
    assert after.link_session == before.link_session == coordinator_side.peer_session != 0
    assert coordinator_side.expected - 1 == after.link_sent
