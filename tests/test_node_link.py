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
