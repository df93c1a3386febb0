"""A request aborted after a decode node reserved blocks for its KV but before any prefill node was
asked to send it: the decode node frees the reservation at once, not at the transfer timeout.

The coordinator runs for real on its sockets; the two nodes on the other end are scripted ZMQ
peers, so the request can be held in exactly that window (the scripted decode node does not
confirm its admission). The decode node's side runs a real engine and KV receiver."""

from __future__ import annotations

import time

import pytest
import zmq
from conftest import RecordingLink
from local_cluster import Cluster

from pdserve.cluster.handoff_state import HandoffState
from pdserve.cluster.node_messages import (
    Abort,
    Admit,
    Admitted,
    FirstToken,
    Heartbeat,
    Message,
    NodeRole,
    Prefill,
    Register,
    orders,
    reports,
)
from pdserve.decode_node.worker import DecodeNode
from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer import make_receiver

pytestmark = pytest.mark.cluster

LAYOUT = KVLayout(2, 8, 2, 32, "float32")


class ScriptedNode:
    """A node as the coordinator sees it: registers, reports load, and answers as told."""

    def __init__(self, endpoint: str, node_id: str, role: str) -> None:
        self.node_id = node_id
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, node_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        decode = role is NodeRole.DECODE
        info = {"transport": "tcp", "address": "tcp://127.0.0.1:1"} if decode else {}
        self.send(
            Register(
                node_id,
                role,
                "pdserve-tiny",
                LAYOUT.block_size,
                64,
                1024,
                "tcp",
                LAYOUT.to_dict(),
                info,
            )
        )
        self.send(Heartbeat(node_id, 64, 64, 0, 0, 0, seq=1))

    def send(self, msg: Message) -> None:
        self.sock.send(reports.encode(msg))

    def expect(self, kind: type, timeout_s: float = 10.0) -> Message:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = orders.decode(self.sock.recv())
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"{self.node_id} got no {kind.__name__}")

    def close(self) -> None:
        self.sock.close(0)


def test_coordinator_marks_an_abort_before_the_kv_was_sent():
    with Cluster(prefill=0, decode=0, keyed=False) as cluster:  # scripted nodes hold no keys
        endpoint = cluster.coordinator.node_endpoint
        prefill = ScriptedNode(endpoint, "scripted-prefill", NodeRole.PREFILL)
        decode = ScriptedNode(endpoint, "scripted-decode", NodeRole.DECODE)
        try:
            cluster.call(cluster.coordinator.wait_for_nodes(1, 1, 10))
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            handle = cluster.call(cluster.coordinator.submit([5, 6, 7], params, "r1"))
            job = prefill.expect(Prefill)
            prefill.send(FirstToken(job.request_id, 9, None, 0, num_blocks=1))
            admit = decode.expect(Admit)  # reserved; the scripted node does not confirm yet
            assert cluster.call(cluster.coordinator.abort(handle.request_id))
            to_decode = decode.expect(Abort)
            to_prefill = prefill.expect(Abort)
            assert to_decode.request_id == admit.request_id and to_decode.kv_unsent
            assert to_prefill.request_id == job.request_id and not to_prefill.kv_unsent
            # The confirmation arrives late: nobody will send into those blocks either.
            decode.send(Admitted(admit.request_id, True, [3]))
            late = decode.expect(Abort)
            assert late.request_id == admit.request_id and late.kv_unsent
        finally:
            prefill.close()
            decode.close()


def _decode_node() -> tuple[DecodeNode, LLMEngine]:
    receivers = []

    def pool_factory(layout, num_blocks):  # noqa: ANN001, ANN202
        receivers.append(make_receiver("tcp", layout, num_blocks))
        return receivers[0].pool

    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=32, block_size=8), pool_factory)
    return DecodeNode(engine, RecordingLink("decode-under-test"), receivers[0]), engine


def _admit(node: DecodeNode, request_id: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    node.handle(Admit(request_id, list(range(5, 25)) + [30], 20, params, 30.0))
    assert node.link.sent[-1] == Admitted(request_id, True, node.link.sent[-1].dst_blocks)


def test_decode_node_frees_an_unsent_reservation_at_once():
    node, engine = _decode_node()
    blocks = engine.block_manager
    try:
        _admit(node, "unsent")
        assert blocks.num_free_blocks == blocks.num_blocks - 3
        node.handle(Abort("unsent", kv_unsent=True))
        assert blocks.num_free_blocks == blocks.num_blocks and node.handoff.num_pending == 0
        node.handle(Abort("unsent"))  # the coordinator may say it twice: a no-op
        time.sleep(0.3)
        node.take_in()
        assert not engine.seqs and not [m for m in node.link.sent if not isinstance(m, Admitted)]

        # Without the mark, a sender may be writing: the blocks wait for the transfer to end.
        _admit(node, "maybe-sent")
        node.handle(Abort("maybe-sent"))
        assert node.handoff.handoffs["maybe-sent"].state is HandoffState.CANCELLED
        assert blocks.num_free_blocks == blocks.num_blocks - 3
    finally:
        node.receiver.close()
