"""KV integrity: every send carries a digest of its pages that the receiver checks once they have
landed. The digest of pages read in place equals that of their gathered buffer (both
algorithms, whole pages and head slices, one plane or two); a flipped or moved word changes it;
a page corrupted on landing (PDSERVE_KV_FAULTS) fails the transfer on both ends over tcp and
shm, is counted, and leaves the pool's other blocks alone; with integrity off the same
corruption lands unnoticed, which is what the check is for."""

from __future__ import annotations

import pytest
import torch
from test_kv_transfer import blocks_bits, random_pool, wait_result

from pdserve.engine.kv.cache import KVLayout
from pdserve.kv_transfer import make_receiver, make_sender, pages
from pdserve.kv_transfer.base import KVSend
from pdserve.kv_transfer.faults import ENV, KVFaults
from pdserve.kv_transfer.integrity import (
    MAX_FUSED_RUNS,
    SUM64,
    XXH3,
    copy_and_digest,
    digest_buffer,
    digest_frames,
    digest_pages,
    gather_and_digest,
    scatter_and_digest,
)

NUM_BLOCKS = 16


def layout(planes: int = 2, dtype: str = "bfloat16") -> KVLayout:
    return KVLayout(4, 4, 2, 8, dtype, planes)


@pytest.mark.parametrize("algorithm", [XXH3, SUM64])
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("heads", [None, (1, 2)])
def test_the_digest_of_pages_in_place_is_that_of_their_gathered_buffer(algorithm, planes, heads):
    kv = torch.randn(pages.pool_shape(layout(planes), NUM_BLOCKS)).to(torch.bfloat16)
    for ids in ([3, 4, 5, 9], [7, 2, 11], [0]):
        gathered = pages.gather(kv, torch.tensor(ids), (1, 3), heads=heads).contiguous()
        assert digest_pages(kv, ids, (1, 3), heads, algorithm) == digest_buffer(gathered, algorithm)
    a, b = kv[0, 0, 2:4], kv[1, 0, 5:6]
    joined = torch.cat([a.reshape(-1), b.reshape(-1)])
    frames = [a.contiguous().view(torch.uint8).numpy(), b.contiguous().view(torch.uint8).numpy()]
    if algorithm == XXH3:  # (frames come straight from CPU pools only)
        assert digest_frames(frames, algorithm) == digest_buffer(joined, algorithm)


@pytest.mark.parametrize("planes", [1, 2])
def test_a_fused_copy_copies_as_pages_copy_does_and_digests_the_source(planes):
    shape = pages.pool_shape(layout(planes), NUM_BLOCKS)
    src = torch.randn(shape).to(torch.bfloat16)
    src_ids, dst_ids = [2, 3, 4, 9, 10], [11, 12, 13, 0, 1]  # two runs
    fused, plain = torch.zeros_like(src), torch.zeros_like(src)
    digest = copy_and_digest(src, src_ids, fused, dst_ids, (1, 4))
    pages.copy(src, src_ids, plain, dst_ids, (1, 4))
    assert torch.equal(fused.view(torch.int16), plain.view(torch.int16))
    assert digest == digest_pages(src, src_ids, (1, 4), None, XXH3)
    assert digest == digest_pages(fused, dst_ids, (1, 4), None, XXH3)
    scattered = list(range(0, 2 * (MAX_FUSED_RUNS + 1), 2))  # more runs than it fuses
    assert copy_and_digest(src, scattered, fused, scattered, (0, 4)) is None


@pytest.mark.parametrize("planes", [1, 2])
def test_a_fused_gather_and_scatter_move_what_the_kernels_move_and_digest_it(planes):
    shape = pages.pool_shape(layout(planes), NUM_BLOCKS)
    kv = torch.randn(shape).to(torch.bfloat16)
    ids = [5, 6, 7, 12, 13]
    expected = pages.gather(kv, torch.tensor(ids), (1, 3))
    out = torch.empty_like(expected)
    digest = gather_and_digest(kv, ids, (1, 3), out)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert digest == digest_buffer(expected, XXH3)
    fused, plain = torch.zeros_like(kv), torch.zeros_like(kv)
    dst = [0, 1, 9, 10, 11]
    landed = scatter_and_digest(fused, expected, dst, (1, 3))
    pages.scatter(plain, expected, torch.tensor(dst), (1, 3))
    assert torch.equal(fused.view(torch.int16), plain.view(torch.int16))
    assert landed == digest
    scattered = list(range(0, 2 * (MAX_FUSED_RUNS + 1), 2))
    assert gather_and_digest(kv, scattered, (0, 1), torch.empty(1)) is None
    assert scatter_and_digest(kv, torch.empty(1), scattered, (0, 1)) is None


@pytest.mark.parametrize("algorithm", [XXH3, SUM64])
def test_a_flipped_or_moved_word_changes_the_digest(algorithm):
    data = torch.randint(-(2**31), 2**31 - 1, (5000,), dtype=torch.int32)
    base = digest_buffer(data, algorithm)
    flipped = data.clone()
    flipped[1234] ^= 1 << 20
    swapped = data.clone()
    swapped[[10, 4000]] = data[[4000, 10]]
    assert digest_buffer(flipped, algorithm) != base
    assert digest_buffer(swapped, algorithm) != base
    assert digest_buffer(data.clone(), algorithm) == base


def test_fault_settings_are_read_or_refused_by_name():
    faults = KVFaults.parse("corrupt=0.25,seed=3")
    assert (faults.corrupt, faults.seed) == (0.25, 3)
    with pytest.raises(ValueError, match="'drop=1'"):
        KVFaults.parse("drop=1")
    with pytest.raises(ValueError, match="'corrupt=2'"):
        KVFaults.parse("corrupt=2")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("planes", [1, 2])
def test_a_page_corrupted_on_landing_fails_the_transfer_and_is_counted(
    transport, planes, monkeypatch
):
    lay = layout(planes)
    pool = random_pool(lay, seed=21)
    monkeypatch.setenv(ENV, "corrupt=1.0,seed=5")
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        monkeypatch.delenv(ENV)
        with make_sender(transport, pool) as sender:
            sender.connect("decode-0", receiver.info())
            untouched = blocks_bits(receiver.pool.kv, [1, 2, 3])
            receiver.expect("t-bad", [8, 9, 10])
            sender.send(KVSend("t-bad", "decode-0", [4, 5, 6], [8, 9, 10]))
            result = wait_result(receiver, "t-bad", 10.0)
            assert not result.ok and "KV integrity check failed" in result.error
            sent = wait_result(sender, "t-bad", 10.0)
            assert not sent.ok and "KV integrity check failed" in sent.error
            assert receiver.stats()["integrity_failures"] == 1
            assert blocks_bits(receiver.pool.kv, [1, 2, 3]) == untouched


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_clean_transfers_pass_and_without_integrity_corruption_lands_unnoticed(
    transport, monkeypatch
):
    lay = layout()
    pool = random_pool(lay, seed=22)
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        with make_sender(transport, pool) as sender:
            sender.connect("decode-0", receiver.info())
            receiver.expect("t-ok", [8, 9])
            sender.send(KVSend("t-ok", "decode-0", [4, 5], [8, 9]))
            assert wait_result(receiver, "t-ok", 10.0).ok
            assert blocks_bits(receiver.pool.kv, [8, 9]) == blocks_bits(pool.kv, [4, 5])
    monkeypatch.setenv(ENV, "corrupt=1.0,seed=5")
    with make_receiver(transport, lay, NUM_BLOCKS) as receiver:
        monkeypatch.delenv(ENV)
        with make_sender(transport, pool, integrity=False) as sender:
            sender.connect("decode-0", receiver.info())
            receiver.expect("t-blind", [8, 9])
            sender.send(KVSend("t-blind", "decode-0", [4, 5], [8, 9]))
            assert wait_result(receiver, "t-blind", 10.0).ok
            assert blocks_bits(receiver.pool.kv, [8, 9]) != blocks_bits(pool.kv, [4, 5])
            assert receiver.stats()["integrity_failures"] == 0
