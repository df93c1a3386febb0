"""A transfer that ends early (cancelled, or failed) is reported only once nothing writes into its
blocks any more, since the decode node frees them on that report and may reuse them at once: at
once for pushed pages, after the copy for a direct write (shm, cuda_ipc) that is under way."""

from __future__ import annotations

import threading

import pytest
from test_kv_transfer import layout, random_pool, wait_result
from waiting import wait_until

from pdserve.kv_transfer import TransferResult, make_receiver, make_sender
from pdserve.kv_transfer.base import KVSend

NUM_BLOCKS = 8


def test_a_cancel_during_a_direct_write_is_reported_after_the_copy(monkeypatch):
    lay = layout()
    with make_receiver("shm", lay, NUM_BLOCKS) as receiver:
        with make_sender("shm", random_pool(lay, seed=3)) as sender:
            copying, finish_copy = threading.Event(), threading.Event()
            original = sender._write

            def slow_write(peer, out):  # noqa: ANN001, ANN202
                copying.set()
                assert finish_copy.wait(30)
                original(peer, out)

            monkeypatch.setattr(sender, "_write", slow_write)
            sender.connect("decode-0", receiver.info())
            receiver.expect("t-1", [1, 2], timeout_s=60)
            sender.send(KVSend("t-1", "decode-0", [3, 4], [1, 2], timeout_s=60))
            assert copying.wait(10), "the sender was never granted its write"
            receiver.cancel("t-1", "aborted")
            wait_until(lambda: receiver.stats()["expected"] == 0)  # the cancel is applied
            assert receiver.poll() == []  # the sender is still copying into blocks 1 and 2
            finish_copy.set()
            assert wait_result(receiver, "t-1", 10.0) == TransferResult("t-1", False, "aborted")
            assert not wait_result(sender, "t-1", 10.0).ok  # it was told to stop


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_cancel_with_no_write_under_way_is_reported_at_once(transport):
    lay = layout()
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        receiver.expect("t-1", [1, 2], timeout_s=3600)
        receiver.cancel("t-1", "aborted")
        assert wait_result(receiver, "t-1", 10.0) == TransferResult("t-1", False, "aborted")
        receiver.cancel("t-1", "aborted")  # it has ended: nothing more to report
        receiver.cancel("never-expected")
        # Commands run in order: once this one is reported, those before it were handled.
        receiver.expect("t-2", [3], timeout_s=3600)
        receiver.cancel("t-2", "aborted")
        seen: list[TransferResult] = []
        wait_until(lambda: seen.extend(receiver.poll()) or seen)
        assert seen == [TransferResult("t-2", False, "aborted")]
