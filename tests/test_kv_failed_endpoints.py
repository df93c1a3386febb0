"""KV endpoints never stall or fail silently: connect() returns before the handshake, and an
endpoint whose thread dies fails everything pending on it (reported by poll() all the same),
refuses every later call with TransportFailed, and its peers hear of it at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from test_kv_transfer import (
    CHUNK,
    CPU_TRANSPORTS,
    NUM_BLOCKS,
    blocks_bits,
    layout,
    random_pool,
    wait_result,
)
from waiting import wait_until

from pdserve.kv_transfer import (
    KVReceiver,
    KVSender,
    TransferResult,
    TransportFailed,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.base import KVSend

pytestmark = pytest.mark.timeout(60)


def wait_results(
    endpoint: KVReceiver | KVSender, ids: set[str], timeout_s: float = 10.0
) -> dict[str, TransferResult]:
    done: dict[str, TransferResult] = {}

    def arrived() -> bool:
        done.update((r.transfer_id, r) for r in endpoint.poll())
        return ids <= done.keys()

    wait_until(arrived, timeout_s)
    return done


def fail_thread_once(
    monkeypatch: pytest.MonkeyPatch, endpoint: object, then: Callable[[], None]
) -> None:
    """Make the endpoint's thread raise at its next round: `_expire` runs every round. `then`
    runs on that thread just before, as a caller racing the failure would."""
    original = endpoint._expire
    fired = threading.Event()

    def expire_then_fail(now: float) -> None:
        if fired.is_set():
            return original(now)
        fired.set()
        then()
        raise RuntimeError("injected failure")

    monkeypatch.setattr(endpoint, "_expire", expire_then_fail)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_sender_whose_thread_fails_fails_every_pending_send_and_refuses_later_calls(
    transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay = layout()
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        with make_sender(transport, random_pool(lay, seed=21), chunk_bytes=CHUNK) as sender:
            sender.connect("decode-0", receiver.info())
            # Never expected: held by the receiver (tcp) or waiting for its Go (shm), unacked.
            sender.send(KVSend("t-unacked", "decode-0", [0, 1], [5, 6]))
            # Nobody listens there: this one waits for the handshake.
            nobody = {**receiver.info(), "address": f"ipc://{tmp_path}/nobody"}
            sender.connect("nobody", nobody)
            sender.send(KVSend("t-handshake", "nobody", [2], [7]))
            wait_until(lambda: receiver.stats()["units"] == 1)
            wait_until(lambda: sender.stats() == {"outstanding": 2, "peers": 1})

            # A send queued as the thread fails is never applied: it fails all the same.
            queue_one = lambda: sender.send(KVSend("t-queued", "decode-0", [3], [8]))  # noqa: E731
            fail_thread_once(monkeypatch, sender, queue_one)

            results = wait_results(sender, {"t-unacked", "t-handshake", "t-queued"})
            assert sender.failed is not None and "injected failure" in sender.failed
            assert {tid: r.error for tid, r in results.items()} == {
                tid: sender.failed for tid in ("t-unacked", "t-handshake", "t-queued")
            }
            assert not any(r.ok for r in results.values())
            with pytest.raises(TransportFailed, match="injected failure"):
                sender.send(KVSend("t-later", "decode-0", [4], [9]))
            with pytest.raises(TransportFailed, match="injected failure"):
                sender.connect("decode-1", receiver.info())
            assert sender.poll() == []  # one result per send, no more
            # Its connection closed, the receiver drops the send it held.
            wait_until(lambda: receiver.stats()["units"] == 0)
            assert receiver.failed is None


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_receiver_whose_thread_fails_fails_every_pending_transfer_and_refuses_later_calls(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay = layout()
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        with make_sender(transport, random_pool(lay, seed=22), chunk_bytes=CHUNK) as sender:
            sender.connect("decode-0", receiver.info())
            receiver.expect("t-half", [1, 2], timeout_s=60.0)
            sender.send(KVSend("t-half", "decode-0", [3, 4], [1, 2], layers=(0, 2)))
            assert wait_result(sender, "t-half", 10.0).ok  # layers 2..3 still missing
            sender.send(
                KVSend("t-held", "decode-0", [5], [7], timeout_s=60.0)
            )  # not expected: held
            wait_until(lambda: receiver.stats()["units"] == 1)

            # An expect queued as the thread fails is never applied: it fails all the same.
            queue_one = lambda: receiver.expect("t-queued", [9], timeout_s=60.0)  # noqa: E731
            fail_thread_once(monkeypatch, receiver, queue_one)

            results = wait_results(receiver, {"t-half", "t-queued"})
            assert receiver.failed is not None and "injected failure" in receiver.failed
            assert results == {
                "t-half": TransferResult("t-half", False, receiver.failed),
                "t-queued": TransferResult("t-queued", False, receiver.failed),
            }
            with pytest.raises(TransportFailed, match="injected failure"):
                receiver.expect("t-later", [10])
            with pytest.raises(TransportFailed, match="injected failure"):
                receiver.cancel("t-half")
            assert receiver.poll() == []
            assert receiver.stats() == {
                "expected": 0,
                "units": 0,
                "held_bytes": 0,
                "peers": 0,
                "integrity_failures": 0,
            }
            # The sender hears at once (a Nack, or its connection closing), not at its timeout.
            held = wait_result(sender, "t-held", 10.0)
            assert not held.ok and "timed out" not in held.error
            assert sender.failed is None


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_connect_returns_before_the_handshake_and_sends_fail_when_nobody_answers(
    transport: str, tmp_path: Path
) -> None:
    lay = layout()
    pool = random_pool(lay, seed=23)
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        nobody = {**receiver.info(), "address": f"ipc://{tmp_path}/nobody"}
        # A handshake that would outlast the test: connect() must not wait for it.
        with make_sender(transport, pool, connect_timeout_s=3600.0) as patient:
            patient.connect("decode-0", nobody)
            patient.send(KVSend("t-patient", "decode-0", [0], [1], timeout_s=0.5))
            result = wait_result(patient, "t-patient", 10.0)
            assert not result.ok and "timed out" in result.error
        # A handshake that times out fails the sends that wait for it, with its own error.
        with make_sender(transport, pool, connect_timeout_s=0.5) as sender:
            sender.connect("decode-0", nobody)
            sender.send(KVSend("t-nobody", "decode-0", [0], [1], timeout_s=3600.0))
            result = wait_result(sender, "t-nobody", 10.0)
            assert not result.ok
            assert "handshake" in result.error and "no answer from ipc://" in result.error
            assert sender.stats() == {"outstanding": 0, "peers": 0}


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_connecting_again_to_the_same_receiver_keeps_the_connection_and_its_sends(
    transport: str,
) -> None:
    lay = layout()
    pool = random_pool(lay, seed=24)
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        with make_sender(transport, pool, chunk_bytes=CHUNK) as sender:
            sender.connect("decode-0", receiver.info())
            sender.send(KVSend("t-again", "decode-0", [2, 3], [8, 9]))  # held: not expected yet
            wait_until(lambda: receiver.stats()["units"] == 1)
            sender.connect("decode-0", receiver.info())  # a reconnect would fail t-again
            receiver.expect("t-again", [8, 9])
            assert wait_result(receiver, "t-again", 10.0).ok
            assert wait_result(sender, "t-again", 10.0).ok
            assert sender.stats() == {"outstanding": 0, "peers": 1}
            assert blocks_bits(receiver.pool.kv, [8, 9]) == blocks_bits(pool.kv, [2, 3])
