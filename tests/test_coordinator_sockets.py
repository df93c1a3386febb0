"""The coordinator's shell on real sockets: junk of any shape at its ports is dropped and logged
once per peer, a task of its that dies makes the process exit non-zero instead of serving errors
forever, and a node whose connection closes and is not made again is found dead by name."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import zmq
import zmq.asyncio
from junk_frames import JUNK

from pdserve.cluster.client_messages import Submit, client_requests
from pdserve.cluster.node_messages import (
    Abort,
    Heartbeat,
    NodeRole,
    Register,
    orders,
    reports,
)
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import Coordinator


async def _poll_until(condition, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    async def wait() -> None:
        while not condition():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(wait(), timeout_s)


def test_junk_of_any_shape_is_dropped_and_logged_once_per_peer(caplog):
    async def run() -> None:
        coordinator = Coordinator(
            CoordinatorConfig(heartbeat_timeout_s=30),
            client_addr="tcp://127.0.0.1:0",
        )
        await coordinator.start()
        ctx = zmq.asyncio.Context.instance()
        strangers = []
        try:
            for endpoint in (coordinator.node_endpoint, coordinator.client_endpoint):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                strangers.append(sock)
                for frames in JUNK:
                    await sock.send_multipart(frames)
            # A node registers after all that, and a client's request reaches it.
            node = ctx.socket(zmq.DEALER)
            node.setsockopt(zmq.IDENTITY, b"d0")
            node.setsockopt(zmq.LINGER, 0)
            node.connect(coordinator.node_endpoint)
            strangers.append(node)
            register = Register("d0", NodeRole.COLOCATED, "m", 4, 64, 1024, "none")
            await node.send(reports.encode(register))
            await coordinator.wait_for_nodes(0, 1, timeout_s=20)
            client = strangers[1]
            params = SamplingParams(max_tokens=2, temperature=0)
            await client.send(client_requests.encode(Submit("r1", [5, 6, 7], params)))
            assert await node.poll(20_000), "the coordinator stopped routing requests"
            generate = orders.decode(await node.recv())
            assert generate.request_id == "r1#0" and generate.token_ids == [5, 6, 7]
            await _poll_until(lambda: coordinator._malformed_clients.total >= len(JUNK) - 1)
            assert not coordinator.failed.is_set()
            assert all(not task.done() for task in coordinator._tasks)
        finally:
            for sock in strangers:
                sock.close(0)
            await coordinator.stop(shutdown_nodes=False)

    with caplog.at_level(logging.WARNING, logger="pdserve.coordinator.coordinator"):
        asyncio.run(run())
    dropped = [r for r in caplog.records if "dropped a malformed message" in r.getMessage()]
    # One line per peer and socket, however many junk messages each sent.
    assert len(dropped) == 2, [r.getMessage() for r in dropped]


def test_a_task_that_dies_marks_the_coordinator_failed(caplog):
    async def run() -> BaseException | None:
        coordinator = Coordinator(CoordinatorConfig())
        await coordinator.start()
        try:
            coordinator.node_sock.close(0)  # its receive loop can no longer go on
            await asyncio.wait_for(coordinator.failed.wait(), 20)
            return coordinator.failure
        finally:
            for task in coordinator._tasks:
                task.cancel()

    with caplog.at_level(logging.CRITICAL, logger="pdserve.coordinator.coordinator"):
        failure = asyncio.run(run())
    assert isinstance(failure, zmq.ZMQError)
    assert any("coordinator-nodes died" in r.getMessage() for r in caplog.records)


def test_serve_exits_non_zero_when_a_coordinator_task_dies(monkeypatch):
    from pdserve.serve import ServeOptions, serve_async

    async def broken_clock(self: Coordinator) -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("a bug in the clock loop")

    monkeypatch.setattr(Coordinator, "_clock_loop", broken_clock)
    options = ServeOptions(start_nodes=False, port=0, node_port=0)
    assert asyncio.run(asyncio.wait_for(serve_async(options), 60)) == 1


@pytest.mark.parametrize("frames", JUNK[:4], ids=["garbage", "multi-frame", "empty", "two-empty"])
def test_a_node_drops_junk_from_the_coordinator(frames):
    from pdserve.cluster.link_session import LinkSession
    from pdserve.cluster.node_link import NodeLink

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = NodeLink(f"tcp://127.0.0.1:{port}", "n0", heartbeat_interval_s=0.5)
    try:
        link.send(Heartbeat("n0", 1, 1, 0, 0, 0))  # so the router knows its identity
        assert router.poll(5000)
        identity, *sent = router.recv_multipart()
        session = LinkSession()  # the coordinator's end of the link's session
        assert session.unwrap(sent, time.monotonic())
        router.send_multipart([identity, *frames])
        router.send_multipart([identity, *session.wrap(orders.encode(Abort("r1")), 0.0)])
        received: list = []
        for _ in range(50):
            received += link.receive(100)
            if received:
                break
        assert received == [Abort("r1")]
        assert link.malformed.total == 1
    finally:
        link.close()
        router.close(0)


def test_send_kv_for_a_closed_handoff_socket_goes_to_the_node_s_main_socket():
    from pdserve.cluster.node_messages import HandoffReady, SendKV
    from pdserve.coordinator.core import Outbox

    async def run() -> object:
        coordinator = Coordinator(CoordinatorConfig(heartbeat_timeout_s=30))
        await coordinator.start()
        ctx = zmq.asyncio.Context.instance()
        main, handoff = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for sock, identity in ((main, b"p0"), (handoff, b"p0/handoff")):
                sock.setsockopt(zmq.IDENTITY, identity)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(coordinator.node_endpoint)
            await main.send(reports.encode(Register("p0", NodeRole.PREFILL, "m", 4, 64, 1024, "x")))
            await handoff.send(reports.encode(HandoffReady("p0")))
            await _poll_until(
                lambda: "p0" in coordinator.handoff_identities and coordinator.nodes.prefill_nodes()
            )
            handoff.close(0)
            await _poll_until(
                lambda: coordinator._send_order(b"p0/handoff", Abort("probe")) is False
            )
            order = SendKV("r1#0", "d0", {}, [1, 2], 30.0)
            coordinator._deliver(Outbox(orders=[(b"p0/handoff", order)]))
            while True:  # the probes' Aborts came through the handoff socket, not this one
                assert await main.poll(10_000), "no SendKV reached the main socket"
                msg = orders.decode(await main.recv())
                if not isinstance(msg, Abort):
                    return msg
        finally:
            main.close(0)
            await coordinator.stop(shutdown_nodes=False)

    assert asyncio.run(run()) == SendKV("r1#0", "d0", {}, [1, 2], 30.0)


def test_a_node_whose_connection_closes_for_good_is_found_one_connected_again_is_not():
    from pdserve.cluster.link_session import LinkSession

    grace = 0.5

    async def run() -> dict[str, float]:
        config = CoordinatorConfig(heartbeat_timeout_s=60, disconnect_grace_s=grace)
        coordinator = Coordinator(config)
        await coordinator.start()
        ctx = zmq.asyncio.Context.instance()
        sockets: dict[str, zmq.asyncio.Socket] = {}

        def connect(node_id: str) -> zmq.asyncio.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, node_id.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(coordinator.node_endpoint)
            sockets[node_id] = sock
            return sock

        async def dead_after(node_id: str) -> float:
            """Close the node's socket for good; seconds until the coordinator has it dead."""
            closed = time.monotonic()
            sockets.pop(node_id).close(0)
            await _poll_until(lambda: not coordinator.nodes.nodes[node_id].alive, 10)
            return time.monotonic() - closed

        try:
            for node_id in ("d0", "d1"):
                register = Register(node_id, NodeRole.DECODE, "m", 4, 64, 1024, "tcp")
                frames = LinkSession().wrap(reports.encode(register), time.monotonic())
                await connect(node_id).send_multipart(frames)
            await coordinator.wait_for_nodes(0, 2, timeout_s=20)
            # d0's connection is cut and made again after ZeroMQ's reconnect interval (0.1 s),
            # by a socket that sends nothing: the check after the grace finds it connected.
            sockets.pop("d0").close(0)
            await asyncio.sleep(0.1)
            connect("d0")
            await asyncio.sleep(grace + 0.5)
            assert coordinator.nodes.nodes["d0"].alive
            found = {"d1": await dead_after("d1")}  # its close is named: d1 alone is checked
            assert coordinator.nodes.nodes["d0"].alive
            # d0's new connection carried nothing, so its close is of unknown owner: every
            # node is checked, and d0 found.
            found["d0"] = await dead_after("d0")
            return found
        finally:
            for sock in sockets.values():
                sock.close(0)
            await coordinator.stop(shutdown_nodes=False)

    found = asyncio.run(run())
    for node_id, seconds in found.items():
        # The grace, then the next tick of the clock (0.1 s), and a loaded machine's delays: far
        # below the 60 s heartbeat timeout, the only other way the node would be found dead.
        assert grace <= seconds < grace + 8.0, (node_id, seconds)
