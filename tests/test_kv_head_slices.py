"""Pages between tensor-parallel groups of different sizes: which prefill rank sends which KV
heads to which decode rank (routes, checked alone), and sends of head slices over tcp and shm
that land bit for bit in the named heads only, a transfer completing once every head of every
layer has come."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_kv_transfer import NUM_BLOCKS, random_pool, wait_result

from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.tp.shard import kv_head_ranges
from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.base import KVSend
from pdserve.kv_transfer.head_routes import route_heads

pytestmark = pytest.mark.timeout(60)


def ranges(size: int, heads: int) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in kv_head_ranges(size, heads)]


SIZES = [
    (heads, p, d)
    for heads in (1, 2, 4, 8)
    for p, d in itertools.product((1, 2, 4, 8), repeat=2)
    if all(heads % s == 0 or s % heads == 0 for s in (p, d))
]


@pytest.mark.parametrize("heads,prefill,decode", SIZES)
def test_every_decode_head_comes_once_from_a_prefill_rank_that_holds_it(heads, prefill, decode):
    src, dst = ranges(prefill, heads), ranges(decode, heads)
    routes = route_heads(src, dst)
    for d, (d0, d1) in enumerate(dst):
        got = []
        for r in (r for r in routes if r.dst_rank == d):
            s0, s1 = src[r.src_rank]
            # Local indexes in both pools, of the same model heads.
            assert r.src_heads[1] - r.src_heads[0] == r.dst_heads[1] - r.dst_heads[0]
            assert s0 + r.src_heads[1] <= s1 and d0 + r.dst_heads[1] <= d1
            assert s0 + r.src_heads[0] == d0 + r.dst_heads[0]
            got += range(d0 + r.dst_heads[0], d0 + r.dst_heads[1])
        assert sorted(got) == list(range(d0, d1))
    if prefill == decode:  # rank i to rank i, whole pages
        assert [(r.src_rank, r.dst_rank) for r in routes] == [(i, i) for i in range(decode)]


def test_replicated_heads_are_sent_by_different_ranks_in_turn():
    # 2 KV heads on 4 prefill ranks (each head on two), to 4 decode ranks alike: rank i to i.
    assert {r.src_rank for r in route_heads(ranges(4, 2), ranges(1, 2))} == {0, 2}
    assert [r.src_rank for r in route_heads(ranges(4, 2), ranges(4, 2))] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="held by no source rank"):
        route_heads([(0, 2)], [(0, 4)])


def layout(heads: int) -> KVLayout:
    return KVLayout(num_layers=3, block_size=4, num_kv_heads=heads, head_dim=8, dtype="bfloat16")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_two_ranks_fill_the_halves_of_one_pool_and_the_transfer_waits_for_both(transport):
    # Prefill TP=2 (2 heads per rank) into decode TP=1 (4 heads).
    receiver = make_receiver(transport, layout(4), NUM_BLOCKS)
    before = receiver.pool.kv.clone()
    pools = [random_pool(layout(2), seed) for seed in (1, 2)]
    senders = [make_sender(transport, pool, chunk_bytes=500) for pool in pools]
    src, dst = [3, 4, 9], [7, 1, 2]
    try:
        receiver.expect("t", dst, timeout_s=20)
        for sender in senders:
            sender.connect("d", receiver.info())
        senders[0].send(KVSend("t", "d", src, dst, heads=(0, 2), dst_heads=(0, 2), timeout_s=20))
        assert wait_result(senders[0], "t", 20).ok
        assert receiver.poll() == []  # heads 2 and 3 have not come
        senders[1].send(KVSend("t", "d", src, dst, dst_heads=(2, 4), timeout_s=20))
        assert wait_result(senders[1], "t", 20).ok
        assert wait_result(receiver, "t", 20).ok
        kv = receiver.pool.kv
        for rank, pool in enumerate(pools):
            landed = kv[:, :, dst, :, 2 * rank : 2 * rank + 2]
            assert torch.equal(landed.view(torch.int16), pool.kv[:, :, src].view(torch.int16))
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert torch.equal(
            kv[:, :, others].view(torch.int16), before[:, :, others].view(torch.int16)
        )
    finally:
        for endpoint in (*senders, receiver):
            endpoint.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_rank_sends_head_slices_to_two_ranks(transport):
    # Prefill TP=1 (4 heads) into decode TP=2 (2 heads per rank).
    receivers = [make_receiver(transport, layout(2), NUM_BLOCKS) for _ in range(2)]
    pool = random_pool(layout(4), seed=3)
    sender = make_sender(transport, pool)
    src, dst = [0, 1, 2, 3], [5, 6, 7, 8]  # consecutive: tcp sends whole pages from the pool
    try:
        for rank, receiver in enumerate(receivers):
            receiver.expect("t", dst, timeout_s=20)
            sender.connect(f"d#{rank}", receiver.info())
        with pytest.raises(ValueError, match="4 KV heads sent into 2"):
            sender.send(KVSend("t", "d#0", src, dst))
        for rank in range(2):
            sender.send(
                KVSend("t", f"d#{rank}", src, dst, heads=(2 * rank, 2 * rank + 2), timeout_s=20)
            )
        for rank, receiver in enumerate(receivers):
            assert wait_result(receiver, "t", 20).ok
            landed = receiver.pool.kv[:, :, dst].view(torch.int16)
            sent = pool.kv[:, :, src, :, 2 * rank : 2 * rank + 2].view(torch.int16)
            assert torch.equal(landed, sent)
    finally:
        for endpoint in (sender, *receivers):
            endpoint.close()
