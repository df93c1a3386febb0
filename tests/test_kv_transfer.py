"""KV transfer across two real processes: pages land exact to the bit in the announced blocks
only, layer by layer, and a peer that dies is an error on the other side, not a hang or a leak.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
from waiting import wait_until

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer import (
    KVReceiver,
    KVSender,
    TransferResult,
    make_receiver,
    make_sender,
    pages,
)
from pdserve.kv_transfer.base import KVSend
from pdserve.tune.remote_endpoint import RemoteEndpoint, pool_bytes, wait_for

pytestmark = pytest.mark.timeout(60)

DTYPES = ["float32", "bfloat16", "float16"]
NUM_BLOCKS = 24
CHUNK = 600  # bytes: makes tcp and nccl cut every send into several chunks


def _gpus_for(transport: str, count: int):
    """cuda_ipc needs one GPU (both processes may share it), nccl two; both need CuPy."""
    has_cupy = importlib.util.find_spec("cupy") is not None
    reason = f"{transport} needs CUDA with {count} device(s) and CuPy"
    ok = has_cupy and torch.cuda.is_available() and torch.cuda.device_count() >= count
    return pytest.param(transport, marks=pytest.mark.skipif(not ok, reason=reason), id=transport)


CPU_TRANSPORTS = ["tcp", "shm"]
TRANSPORTS = [*CPU_TRANSPORTS, _gpus_for("cuda_ipc", 1), _gpus_for("nccl", 2)]
# (sender device, receiver device) of each transport under test
DEVICES = {
    "tcp": ("cpu", "cpu"),
    "shm": ("cpu", "cpu"),
    "cuda_ipc": ("cuda:0", "cuda:0"),
    "nccl": ("cuda:0", "cuda:1"),
}


def layout(dtype: str = "bfloat16", head_dim: int = 8) -> KVLayout:
    return KVLayout(num_layers=4, block_size=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)


def random_pool(lay: KVLayout, seed: int, device: str = "cpu") -> KVPool:
    """A pool of arbitrary bit patterns (NaN payloads too): any conversion would show."""
    width = torch.int32 if lay.dtype == "float32" else torch.int16
    info = torch.iinfo(width)
    g = torch.Generator().manual_seed(seed)
    shape = pages.pool_shape(lay, NUM_BLOCKS)
    bits = torch.randint(info.min, info.max, shape, generator=g, dtype=width)
    return KVPool(lay, NUM_BLOCKS, device, kv=bits.view(lay.torch_dtype).to(device))


def blocks_bits(kv: torch.Tensor, blocks: list[int]) -> bytes:
    return pool_bytes(kv, blocks)


def wait_result(
    endpoint: KVReceiver | KVSender, transfer_id: str, timeout_s: float
) -> TransferResult:
    result = wait_for(endpoint, {}, transfer_id, timeout_s)
    assert result is not None, f"no result for {transfer_id} within {timeout_s}s"
    return result


def _params(transports, dtypes):
    out = []
    for t in transports:
        name, marks = (t, ()) if isinstance(t, str) else (t.values[0], t.marks)
        out += [pytest.param((name, d), marks=marks, id=f"{name}-{d}") for d in dtypes]
    return out


@pytest.fixture(scope="module", params=_params(TRANSPORTS, DTYPES))
def remote_receiver(request):
    """A receiver in a child process, shared by the tests of one (transport, dtype)."""
    transport, dtype = request.param
    remote = RemoteEndpoint(
        "receiver", transport, layout(dtype), NUM_BLOCKS, device=DEVICES[transport][1]
    )
    yield transport, dtype, remote
    remote.close()


def test_pages_arrive_bit_identical_and_other_blocks_stay_untouched(remote_receiver) -> None:
    transport, dtype, remote = remote_receiver
    pool = random_pool(layout(dtype), seed=11, device=DEVICES[transport][0])
    src, dst = [5, 0, 17, 9, 3], [2, 14, 6, 23, 10]
    before = remote.read_blocks(None)
    with make_sender(transport, pool, chunk_bytes=CHUNK) as sender:
        sender.connect("decode-0", remote.info)
        remote.expect("t-bits", dst, timeout_s=10.0)
        sender.send(KVSend("t-bits", "decode-0", src, dst))
        assert wait_result(sender, "t-bits", 10.0).ok
        assert remote.wait("t-bits", 10.0).ok
    assert remote.read_blocks(dst) == blocks_bits(pool.kv, src)
    others = [b for b in range(NUM_BLOCKS) if b not in dst]
    after = torch.frombuffer(bytearray(remote.read_blocks(None)), dtype=torch.uint8)
    before = torch.frombuffer(bytearray(before), dtype=torch.uint8)
    shape = (4, 2, NUM_BLOCKS, -1)
    assert torch.equal(after.view(shape)[:, :, others], before.view(shape)[:, :, others])


@pytest.mark.parametrize("remote_receiver", _params(TRANSPORTS, ["bfloat16"]), indirect=True)
def test_layer_ranges_complete_the_transfer_only_when_all_layers_arrived(remote_receiver) -> None:
    transport, dtype, remote = remote_receiver
    pool = random_pool(layout(dtype), seed=12, device=DEVICES[transport][0])
    src, dst = [1, 2, 3], [20, 4, 12]
    with make_sender(transport, pool, chunk_bytes=CHUNK) as sender:
        sender.connect("decode-0", remote.info)
        remote.expect("t-layers", dst, timeout_s=10.0)
        sender.send(KVSend("t-layers", "decode-0", src, dst, layers=(0, 1)))
        first = wait_result(sender, "t-layers", 10.0)
        assert first.ok and first.layers == (0, 1)
        assert remote.wait("t-layers", 0.2) is None  # layers 1..3 still missing
        got = torch.frombuffer(bytearray(remote.read_blocks(dst)), dtype=torch.uint8).view(4, -1)
        want = torch.frombuffer(bytearray(blocks_bits(pool.kv, src)), dtype=torch.uint8)
        assert torch.equal(got[0], want.view(4, -1)[0]) and not got[1:].any()
        sender.send(KVSend("t-layers", "decode-0", src, dst, layers=(1, 4)))
        assert wait_result(sender, "t-layers", 10.0).layers == (1, 4)
        assert remote.wait("t-layers", 10.0).ok
    assert remote.read_blocks(dst) == blocks_bits(pool.kv, src)


@pytest.mark.parametrize("remote_receiver", _params(["tcp"], ["bfloat16"]), indirect=True)
def test_tcp_sends_runs_of_source_blocks_straight_from_the_pool(remote_receiver) -> None:
    _, dtype, remote = remote_receiver
    pool = random_pool(layout(dtype), seed=16)
    src, dst = [8, 9, 10, 11, 19, 20], [0, 1, 3, 5, 7, 8]  # two runs of source blocks
    with make_sender("tcp", pool, chunk_bytes=CHUNK, min_pool_frame=1) as sender:
        from_pool = []
        send_from_pool = sender._send_from_pool
        sender._send_from_pool = lambda *a: from_pool.append(send_from_pool(*a)) or from_pool[-1]
        sender.connect("decode-0", remote.info)
        remote.expect("t-runs", dst, timeout_s=10.0)
        sender.send(KVSend("t-runs", "decode-0", src, dst))
        assert wait_result(sender, "t-runs", 10.0).ok
        assert remote.wait("t-runs", 10.0).ok
    assert from_pool and all(from_pool)
    assert remote.read_blocks(dst) == blocks_bits(pool.kv, src)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_sender_fails_its_transfers_on_the_receiver_within_the_timeout(
    transport: str,
) -> None:
    lay = layout()
    timeout_s = 8.0
    tx_device, rx_device = DEVICES[transport]
    with make_receiver(transport, lay, NUM_BLOCKS, device=rx_device) as receiver:
        child = RemoteEndpoint(
            "sender", transport, lay, NUM_BLOCKS, device=tx_device, chunk_bytes=CHUNK
        )
        try:
            child.connect("decode-0", receiver.info())
            receiver.expect("t-half", [1, 2], timeout_s=timeout_s)
            child.send(KVSend("t-half", "decode-0", [3, 4], [1, 2], layers=(0, 2)))
            assert child.wait("t-half", 10.0).ok  # half the layers are in
            child.send(
                KVSend("t-early", "decode-0", [5], [7])
            )  # not expected yet: held, not written
            wait_until(lambda: receiver.stats()["units"] == 1)
            start = time.monotonic()
            child.kill()
            result = wait_result(receiver, "t-half", timeout_s + 2.0)
            assert not result.ok and result.error
            assert time.monotonic() - start < timeout_s
        finally:
            child.close()
        wait_until(
            lambda: (
                receiver.stats()
                == {"expected": 0, "units": 0, "held_bytes": 0, "peers": 0, "integrity_failures": 0}
            )
        )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_receiver_fails_the_send_within_the_timeout_and_frees_its_memory(
    transport: str,
) -> None:
    lay = layout()
    timeout_s = 8.0
    tx_device, rx_device = DEVICES[transport]
    child = RemoteEndpoint("receiver", transport, lay, NUM_BLOCKS, device=rx_device)
    try:
        pool = random_pool(lay, seed=13, device=tx_device)
        with make_sender(transport, pool, chunk_bytes=CHUNK) as sender:
            sender.connect("decode-0", child.info)
            # Never expected by the receiver, so never acked: it is in flight when the peer dies.
            sender.send(KVSend("t-orphan", "decode-0", [0, 1], [5, 6], timeout_s=timeout_s))
            wait_until(lambda: sender.stats() == {"outstanding": 1, "peers": 1})
            start = time.monotonic()
            child.kill()
            result = wait_result(sender, "t-orphan", timeout_s + 2.0)
            assert not result.ok and "disconnected" in result.error
            assert time.monotonic() - start < timeout_s
            assert sender.stats() == {"outstanding": 0, "peers": 0}
            if transport == "tcp":
                wait_until(sender._ring.idle)  # staging buffers given back by ZeroMQ
    finally:
        child.close()
    if transport == "shm":  # the killed owner's segment is unlinked by its watchdog
        wait_until(lambda: not os.path.exists(child.info["shm_path"]))


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)  # both ends in this process
def test_mismatched_layout_is_refused_naming_the_field_on_both_sides(transport: str) -> None:
    with make_receiver(transport, layout(), NUM_BLOCKS) as receiver:
        with make_sender(transport, KVPool(layout(head_dim=16), NUM_BLOCKS)) as sender:
            with pytest.raises(ValueError, match="head_dim"):
                sender.connect("decode-0", receiver.info())  # checked by the sender
            forged = {**receiver.info(), "layout": layout(head_dim=16).to_dict()}
            sender.connect("decode-0", forged)  # checked by the receiver, in the handshake
            sender.send(KVSend("t-forged", "decode-0", [0], [1]))
            result = wait_result(sender, "t-forged", 10.0)
            assert not result.ok and "refused" in result.error and "head_dim" in result.error
            assert sender.stats() == {"outstanding": 0, "peers": 0}


def test_a_tcp_sender_whose_chunks_exceed_the_receivers_frame_limit_is_refused_at_connect() -> None:
    with make_receiver("tcp", layout(), NUM_BLOCKS, max_frame_bytes=8 << 20) as receiver:
        assert receiver.info()["max_frame_bytes"] == 8 << 20
        with make_sender("tcp", KVPool(layout(), NUM_BLOCKS), chunk_bytes=16 << 20) as sender:
            with pytest.raises(ValueError, match="chunk_bytes"):
                sender.connect("decode-0", receiver.info())


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)  # both ends in this process
def test_pages_for_an_unannounced_transfer_wait_and_never_touch_the_pool(transport: str) -> None:
    lay = layout()
    pool = random_pool(lay, seed=14)
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        with make_sender(transport, pool, chunk_bytes=CHUNK) as sender:
            sender.connect("decode-0", receiver.info())
            empty = blocks_bits(receiver.pool.kv, [8, 9])
            sender.send(KVSend("t-wait", "decode-0", [2, 3], [8, 9]))
            wait_until(lambda: receiver.stats()["units"] == 1)
            assert blocks_bits(receiver.pool.kv, [8, 9]) == empty
            receiver.expect("t-wait", [8, 9])
            assert wait_result(receiver, "t-wait", 10.0).ok
            assert wait_result(sender, "t-wait", 10.0).ok
            assert blocks_bits(receiver.pool.kv, [8, 9]) == blocks_bits(pool.kv, [2, 3])


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)  # both ends in this process
def test_late_pages_for_a_timed_out_transfer_are_refused(transport: str) -> None:
    lay = layout()
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        with make_sender(transport, random_pool(lay, seed=15)) as sender:
            sender.connect("decode-0", receiver.info())
            receiver.expect("t-late", [4], timeout_s=0.2)
            result = wait_result(receiver, "t-late", 5.0)
            assert not result.ok and "timed out" in result.error
            empty = blocks_bits(receiver.pool.kv, [4])
            sender.send(KVSend("t-late", "decode-0", [0], [4]))
            result = wait_result(sender, "t-late", 5.0)
            assert not result.ok and "refused" in result.error
            assert blocks_bits(receiver.pool.kv, [4]) == empty
