"""The prefill node's handoff socket: its thread announces itself and hands SendKV over as it
arrives; a send that cannot start is settled by the node's loop (blocks freed, coordinator told)."""

from __future__ import annotations

import threading
import time

import zmq
from conftest import RecordingLink

from pdserve.cluster.link_session import LinkSession
from pdserve.cluster.node_messages import (
    HandoffReady,
    Message,
    SendKV,
    TransferDone,
    orders,
    reports,
)
from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_node.handoff_socket import HandoffSocket
from pdserve.prefill_node.worker import PrefillNode


def _recv(sock: zmq.Socket, session: LinkSession, timeout_ms: int = 5000) -> tuple[bytes, Message]:
    """The next report (acknowledgements skipped), through the coordinator's end of the
    socket's link session."""
    while True:
        assert sock.poll(timeout_ms), "nothing arrived"
        identity, *frames = sock.recv_multipart()
        for frame in session.unwrap(frames, time.monotonic()):
            return identity, reports.decode(frame)


def test_listener_announces_itself_and_hands_over_send_orders():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    received: list[tuple[SendKV, str]] = []
    arrived = threading.Event()

    def on_send_kv(msg: SendKV) -> None:
        received.append((msg, threading.current_thread().name))
        arrived.set()

    listener = HandoffSocket(f"tcp://127.0.0.1:{port}", "p0", on_send_kv)
    session = LinkSession()
    try:
        listener.start()
        identity, hello = _recv(router, session)
        assert identity == b"p0/handoff" and hello == HandoffReady("p0")
        order = SendKV("r1", "d0", {"transport": "tcp"}, [4, 5], 30.0)
        router.send_multipart([identity, *session.wrap(orders.encode(order), time.monotonic())])
        assert arrived.wait(5)
        assert received == [(order, "kv-handoff")]  # on the listener's thread
        router.send_multipart([identity, b"\xc1 not a message"])  # dropped, thread lives on
        router.send_multipart([identity, b"two", b"frames"])
        listener.announce()
        assert _recv(router, session) == (identity, HandoffReady("p0"))
    finally:
        listener.close()
        router.close(0)


def test_a_send_that_cannot_start_is_settled_by_the_loop():
    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=32, block_size=8))
    node = PrefillNode(engine, RecordingLink("prefill-under-test"), "tcp")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("held", list(range(5, 30)), params, prefill_only=True)
    while engine.has_unfinished():
        node.report(engine.step())
    node.link.sent.clear()  # the FirstToken
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks - 4  # 25 prompt tokens, held

    # From another thread, as the handoff socket's: an unknown request, then a receiver that
    # speaks another protocol version. Nothing is freed or reported until the loop settles them.
    send_orders = [
        SendKV("unknown", "d0", {"transport": "tcp"}, [1], 30.0),
        SendKV("held", "d0", {"transport": "tcp", "protocol": -1}, [1, 2, 3, 4], 30.0),
    ]
    worker = threading.Thread(target=lambda: [node.send_kv(o) for o in send_orders])
    worker.start()
    worker.join(10)
    assert node.link.sent == [] and blocks.num_free_blocks == blocks.num_blocks - 4
    node.report([])
    sent = sorted(node.link.sent, key=lambda m: m.request_id)
    assert [(m.request_id, m.ok) for m in sent] == [("held", False), ("unknown", False)]
    assert all(isinstance(m, TransferDone) for m in sent)
    assert sent[1].error == "no prefilled KV held here"
    assert sent[0].error.startswith("send failed: protocol mismatch")
    assert blocks.num_free_blocks == blocks.num_blocks and not engine.seqs
    assert node.handoff.num_pending == 0
    node.handoff.close()
