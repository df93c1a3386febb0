"""A node's ranks and their KV endpoints: typed orders on the codec, one worker that carries them
out on every rank (rank 0's in the node's process, another rank's behind a socket pair), and
layer-wise sends that wait for the rank's own forward to have the layer."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.cluster.codec import ProtocolError
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer.base import KVSend, TransferResult
from pdserve.kv_transfer.rank_endpoint import (
    LocalRankLink,
    RankLinks,
    RankWorker,
    endpoint_pair,
)
from pdserve.kv_transfer.rank_messages import RankConnect, RankSend, rank_orders


class RecordingSender:
    """A sender that records its sends (and the thread each came from) and ends each at once."""

    name = "fake"
    failed = None

    def __init__(self) -> None:
        self.sends: list[tuple[str, tuple[int, int], int]] = []
        self._done: list[TransferResult] = []

    def connect(self, peer_id: str, info: dict) -> None:
        if info.get("protocol") == -1:
            raise ValueError("protocol mismatch")

    def send(self, send: KVSend) -> None:
        self.sends.append((send.transfer_id, tuple(send.layers), threading.get_ident()))
        self._done.append(TransferResult(send.transfer_id, True, None, tuple(send.layers)))

    def poll(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def stats(self) -> dict[str, int]:
        return {"outstanding": 0}

    def close(self) -> None:
        pass


def pool() -> KVPool:
    return KVPool(KVLayout(2, 4, 1, 8, "float32"), 8, "cpu")


def worker_with(sender: RecordingSender) -> RankWorker:
    worker = RankWorker(pool())
    worker.senders["fake"] = sender
    return worker


def send(tid: str, after: tuple[int, int] | None, layers: tuple[int, int] = (0, 1)) -> RankSend:
    return RankSend("fake", tid, "d#0", [1], [2], layers, 5.0, after=after)


def test_a_layer_send_waits_for_the_ranks_own_forward_to_have_that_layer():
    sender = RecordingSender()
    worker = worker_with(sender)
    worker.carry_out(send("now", None))
    worker.carry_out(send("layer-1", (3, 1), (1, 2)))
    assert [s[0] for s in sender.sends] == ["now"]
    worker.layer_done(3, 0)
    assert [s[0] for s in sender.sends] == ["now"]  # layer 0 of step 3: not yet
    forward = threading.Thread(target=worker.layer_done, args=(3, 1))
    forward.start()
    forward.join()
    assert [s[0] for s in sender.sends] == ["now", "layer-1"]
    assert sender.sends[1][2] == forward.ident  # sent from the forward's thread (its stream)
    worker.carry_out(send("late", (2, 5)))  # a layer this rank is past: at once
    assert sender.sends[-1][0] == "late"
    reports = worker.collect()
    results = [r.transfer_id for rep in reports if rep.TYPE == "results" for r in rep.results]
    assert results == ["now", "layer-1", "late"]


def test_rank_zeros_connect_raises_what_the_receiver_cannot_take():
    links = RankLinks([LocalRankLink(worker_with(RecordingSender()))])
    with pytest.raises(ValueError, match="protocol mismatch"):
        links.order(0, RankConnect("fake", "d#0", {"protocol": -1}))


def test_orders_are_typed_on_the_codec():
    order = send("t", (4, 2), (2, 3))
    assert rank_orders.decode(rank_orders.encode(order)) == order
    frame = rank_orders.encode(order).replace(b"fake", b"\xc1ake")
    with pytest.raises(ProtocolError):
        rank_orders.decode(frame)


def test_another_ranks_worker_takes_the_same_orders_over_its_line():
    sender = RecordingSender()
    spec, link = endpoint_pair("sender")
    server = spec.serve("cpu")
    server.start(pool())
    server.worker.senders["fake"] = sender
    links = RankLinks([link])
    try:
        links.order(0, send("remote", (0, 0)))
        time.sleep(0.05)
        assert sender.sends == []  # its forward has not reached step 0 layer 0
        server.layer_done(0, 0)
        deadline = time.monotonic() + 10
        results: list = []
        while not results and time.monotonic() < deadline:
            results = links.results("fake")
            time.sleep(0.01)
        assert [(rank, r.transfer_id, r.ok) for rank, r in results] == [(0, "remote", True)]
        assert not links.failed()
    finally:
        links.close()
        server.close()
