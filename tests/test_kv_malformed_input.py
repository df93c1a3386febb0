"""Junk frames to every KV port, of every shape, from strangers: each is dropped, each peer is
logged once (not once per frame), and real transfers through the same endpoints land exact."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import zmq
from test_kv_transfer import (
    CHUNK,
    CPU_TRANSPORTS,
    NUM_BLOCKS,
    blocks_bits,
    layout,
    random_pool,
    wait_result,
)

from pdserve.cluster.codec import seal
from pdserve.engine.kv.cache import KVLayout
from pdserve.kv_transfer import KVReceiver, KVSender, make_receiver, make_sender
from pdserve.kv_transfer.base import KVSend
from pdserve.kv_transfer.pages import page_bytes
from pdserve.kv_transfer.protocol import (
    KV_PROTOCOL_VERSION,
    MAX_CONTROL_BYTES,
    Ack,
    Hello,
    Pages,
    Refuse,
    Welcome,
    control,
)

pytestmark = pytest.mark.timeout(60)


def raw(version: int = KV_PROTOCOL_VERSION, **fields: object) -> bytes:
    """A frame as anyone could write it: any fields, any types."""
    return seal(msgspec.msgpack.encode([version, fields]))


def junk_for_a_receiver(lay: KVLayout) -> list[list[bytes]]:
    """Every shape of junk a receiver's ROUTER can get (after the sender's routing id)."""
    page = page_bytes(lay)  # one block of one layer, K and V
    one_page = Pages("t-junk", 1, (0, 1), 0, 1, page, True, True, [3], (0, 1))
    runs = Pages("t-junk", 2, (0, 1), 0, 1, page, True, True, [3], (0, 1), runs=[1])
    lying = Pages("t-junk", 3, (0, 1), 0, 1, 7, True, True, [3], (0, 1))
    hello = Hello("stranger", "tcp", lay, "host", 1)
    pages = {"transfer_id": "t", "send_id": 1, "layers": [0, 1], "lo": 0, "hi": 1}
    pages |= {"nbytes": page, "first": True, "last": True}
    return [
        [b""],  # an empty frame
        [b"", b"", b""],  # empty frames
        [b"junk", b"more", b"junk"],  # multi-frame junk
        [b"\xc1"],  # not msgpack
        [raw(type="hello", sender=5, transport="tcp", layout={}, host="h", pid="1")],
        [raw(type="begin", transfer_id="t", send_id=-1, layers=[0, 1], dst=[1])],
        [raw(type="pages", **pages)],  # a first chunk that names no blocks
        [raw(version=1, type="ping")],  # another protocol version
        [seal(msgspec.msgpack.encode({"v": 1, "kind": "hello"}))],  # what version 1 sent
        [raw(type="shutdown")],  # not a kv control message
        [control.encode(Welcome())],  # a message that goes the other way
        [control.encode(hello), b"trailing"],  # a good message with a frame too many
        [control.encode(one_page)],  # a Pages header without its payload
        [control.encode(one_page), b"x" * (page - 1)],  # a payload one byte short
        [control.encode(one_page), b"x" * page, b"x" * page],  # one frame too many
        [control.encode(runs), b"x" * page],  # runs: one frame per K and V expected
        [control.encode(lying), b"x" * 7],  # a size its pages do not have
        [b"\x00" * (MAX_CONTROL_BYTES + 1)],  # oversized (shm: ZeroMQ drops the peer)
    ]


def malformed_warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and "malformed message" in r.getMessage()
    ]


def refused_hello(sock: zmq.Socket, lay: KVLayout, timeout_s: float = 10.0) -> None:
    """Say Hello in a transport nobody speaks until the Refuse comes: everything sent before on
    this connection has been read by then. (A peer ZeroMQ dropped for an oversized frame is
    connected again, so the Hello is repeated until it gets through.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.send(control.encode(Hello("stranger", "carrier-pigeon", lay, "host", 1)))
        if sock.poll(200):
            assert isinstance(control.decode(sock.recv()), Refuse)
            return
    raise AssertionError("the receiver never answered")


def transfer_lands_exact(sender: KVSender, receiver: KVReceiver, tid: str) -> None:
    src, dst = [5, 0, 17], [2, 14, 6]
    sender.connect("decode-0", receiver.info())
    receiver.expect(tid, dst)
    sender.send(KVSend(tid, "decode-0", src, dst))
    assert wait_result(sender, tid, 10.0).ok
    assert wait_result(receiver, tid, 10.0).ok
    assert blocks_bits(receiver.pool.kv, dst) == blocks_bits(sender.pool.kv, src)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_junk_frames_to_a_receiver_are_dropped_and_logged_once_per_peer(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    lay = layout()
    ctx = zmq.Context()
    strangers = []
    try:
        with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
            for name in (b"stranger-1", b"stranger-2"):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, name)
                sock.connect(receiver.info()["address"])
                strangers.append(sock)
            for sock in strangers:
                for frames in junk_for_a_receiver(lay):
                    sock.send_multipart(frames)
            for sock in strangers:
                refused_hello(sock, lay)

            pool = random_pool(lay, seed=31)
            with make_sender(transport, pool, chunk_bytes=CHUNK) as sender:
                transfer_lands_exact(sender, receiver, "t-after-junk")
                # No junk was taken for a send, held, or made a peer: only the real sender is.
                stats = receiver.stats()  # (as of the result, which is handed out after them)
                assert stats == {
                    "expected": 0,
                    "units": 0,
                    "held_bytes": 0,
                    "peers": 1,
                    "integrity_failures": 0,
                }
            assert receiver.failed is None
    finally:
        for sock in strangers:
            sock.close(0)
        ctx.term()
    warnings = malformed_warnings(caplog, "pdserve.kv_transfer.receiver")
    assert len(warnings) == 2
    assert all(any(name in w for w in warnings) for name in ("stranger-1", "stranger-2"))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no tracebacks


def junk_for_a_sender() -> list[list[bytes]]:
    """Every shape of junk a sender's DEALER can get from what it took for a receiver."""
    return [
        [b""],
        [b"", b"", b""],
        [b"junk", b"more", b"junk"],
        [b"\xc1"],
        [raw(type="ack", transfer_id=5, send_id="1")],
        [raw(version=1, type="ping")],
        [seal(msgspec.msgpack.encode({"v": 1, "kind": "welcome", "extra": {}}))],
        [control.encode(Hello("impostor", "tcp", layout(), "host", 1))],  # the other way
        [control.encode(Welcome()), b"trailing"],  # a Welcome with a frame too many
        [control.encode(Ack("t-other", 999))],  # well-formed, for no send: ignored
    ]


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_junk_frames_to_a_sender_are_dropped_and_logged_once(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    lay = layout()
    ctx = zmq.Context()
    impostor = ctx.socket(zmq.ROUTER)
    impostor.setsockopt(zmq.LINGER, 0)
    port = impostor.bind_to_random_port("tcp://127.0.0.1")
    try:
        with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
            # A real receiver's info (shm maps its pool), an impostor's address.
            info = {**receiver.info(), "address": f"tcp://127.0.0.1:{port}"}
            pool = random_pool(lay, seed=32)
            with make_sender(transport, pool, chunk_bytes=CHUNK) as sender:
                sender.connect("impostor", info)
                sender.send(KVSend("t-impostor", "impostor", [0], [1], timeout_s=60.0))
                assert impostor.poll(10_000)
                identity, hello = impostor.recv_multipart()
                assert isinstance(control.decode(hello), Hello)
                for frames in junk_for_a_sender():
                    impostor.send_multipart([identity, *frames])
                impostor.send_multipart([identity, control.encode(Refuse("go away"))])
                result = wait_result(sender, "t-impostor", 10.0)
                assert not result.ok and "go away" in result.error  # read after the junk

                # An oversized frame: ZeroMQ drops the connection before reading it.
                sender.send(KVSend("t-oversized", "impostor", [0], [1], timeout_s=60.0))
                assert impostor.poll(10_000)
                identity, _ = impostor.recv_multipart()  # the Hello of a new connection
                impostor.send_multipart([identity, b"\x00" * (MAX_CONTROL_BYTES + 1)])
                result = wait_result(sender, "t-oversized", 10.0)
                assert not result.ok and "disconnected" in result.error

                transfer_lands_exact(sender, receiver, "t-after-junk")
                assert sender.failed is None
    finally:
        impostor.close(0)
        ctx.term()
    assert len(malformed_warnings(caplog, "pdserve.kv_transfer.sender")) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
