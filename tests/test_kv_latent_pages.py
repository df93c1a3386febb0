"""KV pages of one plane (multi-head latent attention's latent, no separate V) move like K and V
pages do: gather, scatter and pool-to-pool copy round trip bit for bit, tcp and shm land the exact
pages, nodes whose layouts differ in planes are refused at the handshake, and between
tensor-parallel groups the latent (one head, whole on every rank) travels once per decode rank,
never once per prefill rank."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.tp.shard import kv_head_ranges
from pdserve.kernels import kv_pages
from pdserve.kv_transfer import (
    KVReceiver,
    KVSender,
    TransferResult,
    make_receiver,
    make_sender,
    pages,
)
from pdserve.kv_transfer.base import KVSend
from pdserve.kv_transfer.protocol import Hello, control
from pdserve.kv_transfer.rank_endpoint import LocalRankLink, RankWorker
from pdserve.kv_transfer.receiver import ZmqReceiver
from pdserve.kv_transfer.sharded import ShardedReceiver, ShardedSender, rank_links
from pdserve.tune.remote_endpoint import wait_for

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS = 16
DTYPES = ["float32", "bfloat16"]
_INT = {"float32": torch.int32, "bfloat16": torch.int16}


def latent(dtype: str = "bfloat16") -> KVLayout:
    """3 layers of one latent "head" 24 wide (DeepSeek's is 512 + 64), one plane."""
    return KVLayout(num_layers=3, block_size=4, num_kv_heads=1, head_dim=24, dtype=dtype, planes=1)


def random_pool(lay: KVLayout, seed: int) -> KVPool:
    """A pool of arbitrary bit patterns (NaN payloads too): any conversion would show."""
    width = _INT[lay.dtype]
    info = torch.iinfo(width)
    g = torch.Generator().manual_seed(seed)
    shape = pages.pool_shape(lay, NUM_BLOCKS)
    bits = torch.randint(info.min, info.max, shape, generator=g, dtype=width)
    return KVPool(lay, NUM_BLOCKS, "cpu", kv=bits.view(lay.torch_dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def wait_result(endpoint: KVReceiver | KVSender, transfer_id: str) -> TransferResult:
    result = wait_for(endpoint, {}, transfer_id, 20.0)
    assert result is not None, f"no result for {transfer_id}"
    return result


def wait_results(endpoint: KVSender, count: int) -> list[TransferResult]:
    """The results of `count` sends (of one transfer: wait_for would keep only the last)."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + 20.0
    while len(results) < count and time.monotonic() < deadline:
        results += endpoint.poll()
        time.sleep(0.001)
    assert len(results) == count, results
    return results


# -- kernels -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_pages_gather_and_scatter_bit_for_bit_and_nothing_else(dtype: str) -> None:
    src, dst = random_pool(latent(dtype), 1).kv, random_pool(latent(dtype), 2).kv
    before = dst.clone()
    buf = kv_pages.gather_blocks(src, [7, 0, 11], layers=(1, 3))
    assert buf.shape == (2, 1, 3, 4, 1, 24)  # one plane: half a K/V buffer's bytes
    assert torch.equal(bits(buf), bits(src[1:3][:, :, [7, 0, 11]]))
    kv_pages.scatter_blocks(dst, buf, [2, 8, 5], layers=(1, 3))
    assert torch.equal(bits(dst[1:3][:, :, [2, 8, 5]]), bits(src[1:3][:, :, [7, 0, 11]]))
    mask = torch.ones(dst.shape[:3], dtype=torch.bool)
    mask[1:3, :, [2, 8, 5]] = False
    assert torch.equal(bits(dst[mask]), bits(before[mask]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "src_ids, dst_ids",
    [
        (list(range(0, 10)), list(range(6, 16))),  # one long run: copied as slices
        ([5, 13, 3, 9, 0, 11], [1, 2, 3, 15, 8, 6]),  # scattered: through the scratch buffer
    ],
)
def test_latent_copy_blocks_equals_gather_then_scatter(
    dtype: str, src_ids: list[int], dst_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_pages, "_COPY_CHUNK_BYTES", 200)  # several scratch rounds
    src = random_pool(latent(dtype), 3).kv
    want = random_pool(latent(dtype), 4).kv
    got = want.clone()
    kv_pages.scatter_blocks(want, kv_pages.gather_blocks(src, src_ids, (0, 3)), dst_ids, (0, 3))
    kv_pages.copy_blocks(src, src_ids, got, dst_ids)
    assert torch.equal(bits(got), bits(want))


def test_pages_are_never_copied_between_pools_of_different_planes() -> None:
    one = torch.zeros(pages.pool_shape(latent(), 4), dtype=torch.bfloat16)
    two = torch.zeros(pages.pool_shape(KVLayout(3, 4, 1, 24, "bfloat16"), 4), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pools differ"):
        kv_pages.copy_blocks(one, [0], two, [0])
    with pytest.raises(ValueError, match="buffer"):
        kv_pages.scatter_blocks(one, kv_pages.gather_blocks(two, [0]), [0])


# -- transports ----------------------------------------------------------------------------------


@dataclass
class Arrived:
    """What crossed into one receiver: every send it opened (its sender, layers, blocks, heads)
    and, for pushed pages, the bytes of the frames that came and how each chunk came."""

    sends: list[dict] = field(default_factory=list)
    frame_bytes: int = 0
    from_pool: list[bool] = field(default_factory=list)  # per chunk: page runs, not a gather

    def page_bytes(self, lay: KVLayout) -> int:
        """Bytes of the pages of every send: layers x blocks x one page of each plane."""
        return sum(
            (s["layers"][1] - s["layers"][0]) * s["blocks"] * pages.page_bytes(lay)
            for s in self.sends
        )


def watch(receiver: ZmqReceiver) -> Arrived:
    arrived = Arrived()
    opened, received = receiver._open, receiver._receive

    def _open(peer, tid, send_id, dst, layers, timeout_s, direct, heads):  # noqa: ANN001, ANN202
        arrived.sends.append({"peer": peer, "layers": tuple(layers), "blocks": len(dst)})
        arrived.sends[-1]["heads"] = heads
        return opened(peer, tid, send_id, dst, layers, timeout_s, direct, heads)

    def _receive(peer, msg, frames):  # noqa: ANN001, ANN202
        arrived.frame_bytes += sum(len(f) for f in frames)
        arrived.from_pool.append(msg.runs is not None)
        return received(peer, msg, frames)

    receiver._open, receiver._receive = _open, _receive
    return arrived


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize(
    "src, dst, from_pool",
    [
        ([3, 9, 0, 12, 6], [7, 1, 2, 15, 10], False),  # tcp gathers each chunk into a buffer
        ([4, 5, 6, 7], [8, 9, 10, 11], True),  # tcp sends the run from the pool, plane by plane
    ],
)
def test_latent_pages_land_exactly_in_the_announced_blocks(
    transport, dtype, src, dst, from_pool
) -> None:
    lay = latent(dtype)
    receiver = make_receiver(transport, lay, NUM_BLOCKS)
    before = receiver.pool.kv.clone()
    pool = random_pool(lay, seed=5)
    # chunk_bytes: tcp cuts the send into several chunks (a page is 192 or 384 bytes)
    options = {}
    if transport == "tcp":
        options = {"min_pool_frame": 1} if from_pool else {"max_pool_runs": 0}
    sender = make_sender(transport, pool, chunk_bytes=800, **options)
    arrived = watch(receiver)
    try:
        sender.connect("d", receiver.info())
        receiver.expect("t", dst, timeout_s=20)
        sender.send(KVSend("t", "d", src, dst, layers=(0, 1), timeout_s=20))
        sender.send(KVSend("t", "d", src, dst, layers=(1, 3), timeout_s=20))
        assert all(r.ok for r in wait_results(sender, 2))
        assert wait_result(receiver, "t").ok
        kv = receiver.pool.kv
        assert torch.equal(bits(kv[:, :, dst]), bits(pool.kv[:, :, src]))
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert torch.equal(bits(kv[:, :, others]), bits(before[:, :, others]))
        page = 4 * 24 * torch.empty(0, dtype=lay.torch_dtype).element_size()  # one plane
        assert arrived.page_bytes(lay) == 3 * len(src) * page
        if transport == "tcp":  # what came over the socket: the latent pages, no V
            assert arrived.frame_bytes == 3 * len(src) * page
            assert len(arrived.from_pool) > 2 and set(arrived.from_pool) == {from_pool}
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_nodes_whose_layouts_differ_in_planes_are_refused_at_the_handshake(transport) -> None:
    mla = latent()
    kv_heads = KVLayout(3, 4, 1, 24, "bfloat16")  # same shape of page, K and V
    hello = Hello("s", transport, mla, "host", 1)
    assert control.decode(control.encode(hello)).layout.planes == 1  # the handshake carries it
    receiver = make_receiver(transport, mla, NUM_BLOCKS)
    sender = make_sender(transport, KVPool(kv_heads, NUM_BLOCKS))
    mla_sender = make_sender(transport, KVPool(mla, NUM_BLOCKS))
    try:
        with pytest.raises(ValueError, match="mismatch in field 'planes': 2 != 1"):
            sender.connect("d", receiver.info())
        # A receiver info from before planes (no such field) means K and V: an MLA sender refuses.
        old = {**receiver.info(), "layout": {**mla.to_dict()}}
        del old["layout"]["planes"]
        with pytest.raises(ValueError, match="mismatch in field 'planes': 1 != 2"):
            mla_sender.connect("d", old)
        # And the receiver checks the Hello itself (a sender told the receiver had K and V).
        if transport == "tcp":  # (shm maps the pool first, from the layout it is told)
            told = {**receiver.info(), "layout": kv_heads.to_dict()}
            sender.connect("d", told)
            receiver.expect("t", [0], timeout_s=10)
            sender.send(KVSend("t", "d", [0], [0], timeout_s=10))
            result = wait_result(sender, "t")
            assert not result.ok and "mismatch in field 'planes': 1 != 2" in result.error
    finally:
        for endpoint in (sender, mla_sender, receiver):
            endpoint.close()


# -- tensor-parallel groups ----------------------------------------------------------------------


def heads(size: int) -> list[tuple[int, int]]:
    """Every rank's KV heads of an MLA model: the one latent, whole on each."""
    return [(r.start, r.stop) for r in kv_head_ranges(size, 1)]


def prefill_group(transport: str, pools: list[KVPool]) -> ShardedSender:
    remote = [LocalRankLink(RankWorker(pool)) for pool in pools[1:]]
    links = rank_links(pools[0], remote, {"chunk_bytes": 800})
    return ShardedSender(transport, pools[0], links, heads(len(pools)), latent())


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_two_prefill_ranks_send_one_copy_of_the_latent_to_one_decode_rank(transport) -> None:
    assert heads(2) == [(0, 1), (0, 1)]  # replicated: every rank holds the whole latent
    receiver = make_receiver(transport, latent(), NUM_BLOCKS)
    arrived = watch(receiver)
    # The ranks' latents are equal in a real node; here they differ, to see whose landed.
    pools = [random_pool(latent(), seed) for seed in (1, 2)]
    sender = prefill_group(transport, pools)
    src, dst = [3, 4, 9], [7, 1, 2]
    try:
        sender.connect("d", receiver.info())
        receiver.expect("t", dst, timeout_s=20)
        sender.send(KVSend("t", "d", src, dst, timeout_s=20))
        assert wait_result(sender, "t").ok
        assert wait_result(receiver, "t").ok
        assert len(arrived.sends) == 1 and arrived.sends[0]["heads"] is None  # whole pages
        one_copy = 3 * len(src) * pages.page_bytes(latent())
        assert arrived.page_bytes(latent()) == one_copy
        if transport == "tcp":
            assert arrived.frame_bytes == one_copy
        assert sender.links.links[1].worker.senders == {}  # rank 1 never even connected
        assert torch.equal(bits(receiver.pool.kv[:, :, dst]), bits(pools[0].kv[:, :, src]))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_prefill_rank_gives_each_of_two_decode_ranks_the_latent_once(transport) -> None:
    receivers = [make_receiver(transport, latent(), NUM_BLOCKS) for _ in range(2)]
    arrived = [watch(r) for r in receivers]
    remote = [LocalRankLink(RankWorker(receivers[1].pool, receivers[1]))]
    decode = ShardedReceiver(receivers[0], remote, heads(2), latent())
    pool = random_pool(latent(), seed=3)
    sender = prefill_group(transport, [pool])
    src, dst = [0, 1, 2, 3], [5, 6, 7, 8]
    try:
        sender.connect("d", decode.info())
        decode.expect("t", dst, timeout_s=20)
        sender.send(KVSend("t", "d", src, dst, timeout_s=20))
        assert wait_result(sender, "t").ok
        assert wait_result(decode, "t").ok
        one_copy = 3 * len(src) * pages.page_bytes(latent())
        assert [len(a.sends) for a in arrived] == [1, 1]  # one send into each rank
        # Two copies in all, not four (nor one rank's pages split between the two).
        assert [a.page_bytes(latent()) for a in arrived] == [one_copy, one_copy]
        if transport == "tcp":
            assert [a.frame_bytes for a in arrived] == [one_copy, one_copy]
        for receiver in receivers:
            assert torch.equal(bits(receiver.pool.kv[:, :, dst]), bits(pool.kv[:, :, src]))
    finally:
        sender.close()
        decode.close()
