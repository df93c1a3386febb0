"""KV tiers under the prefix cache: the host and disk tiers' bookkeeping alone, and an engine whose
pool is far smaller than its conversations: blocks come back from host memory or disk with the
bytes they left with, and every turn's greedy output equals the engine's without tiers, whichever
tier its prefix came from; a failed disk read or write falls back to computing the block."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from pdserve.cluster.block_hash import prefix_hashes
from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.disk_tier import DiskBlockError, DiskTier, read_block, write_block
from pdserve.engine.kv.events import KVEvents
from pdserve.engine.kv.host_tier import HostTier
from pdserve.engine.llm_engine import LLMEngine

BLOCK = 4
POOL = 40  # blocks: one conversation's two turns fit, six do not
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def key(i: int) -> tuple[int | None, tuple[int, ...]]:
    return (None, (i, i, i, i))


# --- the host tier alone ----------------------------------------------------------------------


def test_host_tier_serves_committed_blocks_only_and_evicts_least_recently_used():
    events = KVEvents()
    tier = HostTier(LAYOUT, 3 * LAYOUT.bytes_per_block, events=events)
    assert tier.num_slots == 3
    slots = [tier.reserve(h) for h in (1, 2, 3)]
    assert sorted(slots) == [0, 1, 2]
    assert tier.lookup(1, key(1)) is None  # reserved, copy not complete: never served
    for h in (1, 2, 3):
        tier.commit(h, key(h))
    assert tier.lookup(1, key(1)) == slots[0]  # 1 is now the most recently used
    assert tier.lookup(2, key(9)) is None  # another block under the same hash: not served
    slot = tier.reserve(4)  # evicts 2, the least recently used
    assert slot == slots[1] and not tier.holds(2) and tier.holds(4)
    batches = events.drain()
    assert [(b.stored, b.tier, b.hashes) for b in batches] == [
        (True, "host", [1, 2, 3]),
        (False, "host", [2]),
    ]


def test_host_tier_never_evicts_a_pinned_slot_and_refuses_when_all_are_in_use():
    tier = HostTier(LAYOUT, 2 * LAYOUT.bytes_per_block)
    a, b = tier.reserve(1), tier.reserve(2)
    tier.commit(1, key(1))
    tier.pin(a)
    assert tier.reserve(3) is None  # 1 pinned, 2 in flight
    tier.commit(2, key(2))
    assert tier.reserve(3) == b  # 2 goes, 1 stays pinned
    tier.unpin(a)
    tier.abandon(3)  # 3's copy failed: its slot is free again
    assert tier.reserve(4) == b
    with pytest.raises(ValueError, match="already"):
        tier.reserve(1)


# --- the disk tier alone ----------------------------------------------------------------------


def test_a_block_file_reads_back_the_same_bytes_and_refuses_anything_else(tmp_path: Path):
    pages = torch.randn(2, 2, 4, 2, 8)
    path = str(tmp_path / "b.kv")
    write_block(path, LAYOUT, key(5), pages)
    out = torch.empty_like(pages)
    read_block(path, LAYOUT, key(5), out)
    assert torch.equal(out, pages)
    with pytest.raises(DiskBlockError, match="another block"):
        read_block(path, LAYOUT, key(6), out)
    data = bytearray(Path(path).read_bytes())
    data[-5] ^= 0x10  # one bit of the pages
    Path(path).write_bytes(bytes(data))
    with pytest.raises(DiskBlockError, match="digest"):
        read_block(path, LAYOUT, key(5), out)
    Path(path).write_bytes(bytes(data[:-4]))
    with pytest.raises(DiskBlockError, match="bytes of pages"):
        read_block(path, LAYOUT, key(5), out)
    with pytest.raises(DiskBlockError):
        read_block(str(tmp_path / "gone.kv"), LAYOUT, key(5), out)


def test_disk_tier_evicts_least_recently_used_files_within_its_bytes(tmp_path: Path):
    tier = DiskTier(LAYOUT, str(tmp_path), 2 * LAYOUT.bytes_per_block)
    assert tier.reserve(1) == [] and tier.reserve(2) == []
    assert tier.reserve(3) is None  # both being written
    tier.commit(1, key(1))
    tier.commit(2, key(2))
    assert tier.lookup(1, key(1))
    tier.pin(1)
    assert tier.reserve(3) == [tier.file(2)]  # 2: least recently used of those not read
    assert not tier.holds(2) and tier.holds(1)
    assert Path(tier.directory).parent == tmp_path
    tier.close()
    assert not os.path.exists(tier.directory)


def test_a_dead_node_s_disk_tier_is_removed_by_the_next_one_on_the_path(tmp_path: Path):
    import subprocess
    import sys

    # A process that made a tier directory and was killed before it could remove it.
    code = (
        "import os, sys; from pdserve.engine.kv.disk_tier import DiskTier; "
        "from pdserve.engine.kv.cache import KVLayout; "
        "t = DiskTier(KVLayout(2, 4, 2, 8, 'float32'), sys.argv[1], 1 << 20); "
        "print(t.directory, flush=True); os._exit(0)"
    )
    dead = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert os.path.isdir(dead)
    mine = DiskTier(LAYOUT, str(tmp_path), LAYOUT.bytes_per_block)
    assert not os.path.exists(dead) and os.path.isdir(mine.directory)
    other = DiskTier(LAYOUT, str(tmp_path), LAYOUT.bytes_per_block)  # a live one's stays
    assert os.path.isdir(mine.directory)
    other.close()
    mine.close()


# --- an engine with tiers ---------------------------------------------------------------------


def conversations(n: int = 6, length: int = 60, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(length)] for _ in range(n)]


BPB = 2048  # bytes of one KV block of pdserve-tiny (the suite's model) in float32


def make_engine(**options) -> LLMEngine:
    return LLMEngine(
        EngineConfig(block_size=BLOCK, num_kv_blocks=POOL, max_num_batched_tokens=512, **options)
    )


def run(engine: LLMEngine, prompt: list[int], request_id: str) -> tuple[list[int], int]:
    seq = engine.add_request(request_id, prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids, seq.num_cached_tokens


def two_turns(engine: LLMEngine, convs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Every conversation's first turn, then every second turn (the first turn's prompt, its
    answer and a new message): a pool of POOL blocks has long evicted the early ones."""
    outputs, cached = [], []
    answers = []
    for i, prompt in enumerate(convs):
        out, _ = run(engine, prompt, f"c{i}-1")
        outputs.append(out)
        answers.append(out)
    for i, prompt in enumerate(convs):
        out, n = run(engine, prompt + answers[i] + [11, 12, 13], f"c{i}-2")
        outputs.append(out)
        cached.append(n)
    return outputs, cached


@pytest.fixture(scope="module")
def plain() -> tuple[list[list[int]], list[int]]:
    engine = make_engine()
    try:
        return two_turns(engine, conversations())
    finally:
        engine.close()


def test_without_tiers_the_second_turns_are_computed_again(plain):
    _, cached = plain
    assert cached == [0] * 6  # the pool evicted every first turn


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_second_turns_load_their_prefix_from_a_lower_tier_and_match(tier, plain, tmp_path):
    options = {"kv_host_bytes": 1 << 20}
    if tier == "disk":  # a host tier of 24 blocks under a disk tier: the early turns left it
        options = {"kv_host_bytes": 24 * BPB, "kv_disk_path": str(tmp_path)}
    engine = make_engine(**options)
    try:
        assert engine.layout.bytes_per_block == BPB
        outputs, cached = two_turns(engine, conversations())
        stats = engine.tiers.stats
        assert outputs == plain[0]
        # Each second turn (71 tokens) finds its first turn's 60-token prompt and 8-token answer
        # below the pool: 17 full blocks minus the one holding the answer's tail (not full at
        # the time), at least.
        assert all(n >= 14 * BLOCK for n in cached), cached
        assert stats.hit_blocks[tier] >= 14 and stats.failures == 0
        assert stats.loaded_bytes[tier] == stats.hit_blocks[tier] * BPB
        if tier == "disk":
            assert engine.tiers.disk.num_blocks > engine.tiers.host.num_slots
        assert engine.block_manager.num_free_blocks == POOL  # every block back
    finally:
        engine.close()


def test_a_block_loaded_back_holds_the_bytes_it_left_with():
    engine = make_engine(kv_host_bytes=1 << 20)
    try:
        prompt = conversations(1, 61, seed=5)[0]  # 15 full blocks
        run(engine, prompt, "first")
        hashes = prefix_hashes(prompt, BLOCK)[:15]
        bm = engine.block_manager
        blocks = [bm._cached[h] for h in hashes]
        before = engine.pool.kv[:, :, blocks].clone()
        for i, other in enumerate(conversations(3, 60, seed=6)):  # evict them from the pool
            run(engine, other, f"other-{i}")
        assert not any(bm._cached.get(h) in blocks for h in hashes[:1])
        engine.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0))
        engine.step()  # submits the load; the step loop goes on
        assert "again" in engine.scheduler.loading
        while engine.scheduler.loading:
            engine.step()
        after = engine.pool.kv[:, :, [bm._cached[h] for h in hashes]]
        assert torch.equal(after, before)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()


def test_a_full_host_tier_evicts_and_never_holds_up_a_step():
    engine = make_engine(kv_host_bytes=6 * BPB)
    try:
        outputs, _ = two_turns(engine, conversations())
        assert engine.tiers.host.num_blocks <= 6
        assert engine.tiers.stats.written_bytes["host"] > 6 * BPB  # it kept taking blocks
        # Pin every slot: the next blocks are skipped, not waited for.
        for slot in range(6):
            engine.tiers.host.pin(slot)
        skipped = engine.tiers.stats.skipped_stores
        run(engine, conversations(1, 40, seed=9)[0], "pinned")
        assert engine.tiers.stats.skipped_stores > skipped
    finally:
        engine.close()


def test_a_failed_disk_read_falls_back_to_computing_with_the_same_tokens(plain, tmp_path):
    engine = make_engine(kv_host_bytes=4 * BPB, kv_disk_path=str(tmp_path))
    try:
        convs = conversations()
        answers = [run(engine, p, f"c{i}-1")[0] for i, p in enumerate(convs)]
        while engine.has_unfinished():  # the last disk writes
            engine.step()
        # Corrupt the file of the first conversation's fifth block, delete its ninth.
        hashes = prefix_hashes(convs[0], BLOCK)
        disk = engine.tiers.disk
        path = Path(disk.file(hashes[4]))
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        os.unlink(disk.file(hashes[8]))
        out, cached = run(engine, convs[0] + answers[0] + [11, 12, 13], "c0-2")
        assert out == plain[0][6]
        assert cached == 4 * BLOCK  # the four blocks before the corrupt one
        assert engine.tiers.stats.failures == 1
        # The corrupt file was dropped and the block, computed again, written anew: intact.
        while engine.has_unfinished():
            engine.step()
        key = engine.block_manager.key(engine.block_manager._cached[hashes[4]])
        read_block(
            disk.file(hashes[4]), engine.layout, key, torch.empty_like(engine.tiers.host.buffer[0])
        )
        assert engine.block_manager.num_free_blocks == POOL
    finally:
        engine.close()


def test_a_failed_disk_write_is_counted_and_changes_no_token(plain, tmp_path):
    engine = make_engine(kv_host_bytes=4 * BPB, kv_disk_path=str(tmp_path))
    try:
        os.rmdir(engine.tiers.disk.directory)  # every write now fails
        outputs, _ = two_turns(engine, conversations())
        assert outputs == plain[0]
        assert engine.tiers.stats.failures > 0 and engine.tiers.disk.num_blocks == 0
    finally:
        engine.close()


def test_an_abort_while_loading_frees_every_block_once_the_load_ends():
    engine = make_engine(kv_host_bytes=1 << 20)
    try:
        convs = conversations()
        for i, prompt in enumerate(convs):
            run(engine, prompt, f"c{i}")
        engine.add_request("again", convs[0], GREEDY)
        engine.step()
        assert "again" in engine.scheduler.loading
        assert engine.abort("again")
        while engine.has_unfinished():
            engine.step()
        assert engine.block_manager.num_free_blocks == POOL
        assert not engine.tiers.busy
    finally:
        engine.close()


def test_an_unset_host_tier_is_twice_the_pool_on_a_gpu_within_the_host_s_share():
    from pdserve.engine.kv.tiers import default_host_share, host_tier_bytes

    unset, gib = EngineConfig(), 1 << 30
    assert host_tier_bytes(unset, 70 * gib, True, host_share=1000 * gib) == 140 * gib
    assert host_tier_bytes(unset, 70 * gib, True, host_share=60 * gib) == 60 * gib  # 8 GPUs
    assert host_tier_bytes(unset, 70 * gib, False) == 0  # a CPU node: its pool is host memory
    assert host_tier_bytes(EngineConfig(kv_disk_path="/d"), 5 * gib, False) == 5 * gib
    assert host_tier_bytes(EngineConfig(kv_host_bytes=3), 70 * gib, True) == 3  # as asked
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < default_host_share() <= memory // 2


def test_tier_settings_are_checked():
    with pytest.raises(ValueError, match="sits under the host tier"):
        EngineConfig(kv_host_bytes=0, kv_disk_path="/tmp/x")
    with pytest.raises(ValueError, match="nodes of one process"):
        EngineConfig(kv_host_bytes=1 << 20, tensor_parallel_size=2)
    engine = make_engine()  # a CPU node: no host tier unless asked for
    try:
        assert engine.tiers is None
    finally:
        engine.close()


# --- a decode node's handoff with tiers -------------------------------------------------------


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_handoff_takes_its_prefix_from_the_tiers_and_computes_what_failed(corrupt, tmp_path):
    from pdserve.cluster.sampling_params import SamplingParams as Params
    from pdserve.decode_node.handoff import DecodeHandoff
    from pdserve.engine.kv.block_manager import BlockManager
    from pdserve.engine.kv.cache import KVPool
    from pdserve.engine.kv.tiers import KVTiers
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.sequence import Sequence
    from pdserve.kv_transfer import make_receiver

    bm = BlockManager(16, LAYOUT.block_size)
    pool = KVPool(LAYOUT, 16)
    pool.kv.copy_(torch.randn_like(pool.kv))
    host = HostTier(LAYOUT, LAYOUT.bytes_per_block)  # block 0: the others only on disk
    tiers = KVTiers(pool, bm, host, DiskTier(LAYOUT, str(tmp_path), 1 << 20))
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks of KV, then the last token's
    table: list[int] = []
    assert bm.allocate_slots(table, 12)
    bm.cache_full_blocks(table, prompt, 12)
    pages = pool.kv[:, :, table].clone()
    tiers.store_new()
    while tiers.busy:
        tiers.wait(1.0)
        tiers.poll()
    assert tiers.disk.num_blocks == 3
    bm.free(table)
    bm.reset_prefix_cache()  # out of the pool: below it alone
    pool.kv.zero_()
    hashes = prefix_hashes(prompt, LAYOUT.block_size)
    if corrupt:
        path = Path(tiers.disk.file(hashes[1]))
        path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    receiver = make_receiver("tcp", LAYOUT, 16)
    try:
        handoff = DecodeHandoff(receiver, bm, tiers=tiers)
        seq = Sequence("r1", prompt, Params(max_tokens=4, temperature=0))
        seq.token_ids.append(99)  # the first token, sampled by the prefill node
        seq.num_computed_tokens = 12  # the decode node computes the last prompt token's KV
        assert handoff.reserve(seq, 10.0, reuse_prefix=True) == []  # nothing to receive
        arrived = []
        while not arrived:
            tiers.wait(1.0)
            tiers.poll()
            arrived, _ = handoff.poll()
        assert arrived == [seq]
        # With block 1's file corrupt, block 0 came back and the rest is computed here.
        loaded = 1 if corrupt else 3
        assert seq.num_computed_tokens == 4 * loaded
        assert torch.equal(pool.kv[:, :, seq.block_table[:loaded]], pages[:, :, :loaded])
        assert tiers.stats.failures == int(corrupt)
        # Its table holds what its KV holds: the decode node's first step computes the rest.
        assert len(seq.block_table) == loaded
        scheduler = Scheduler(bm, 4, 64)
        scheduler.add_running(seq)
        (step,) = scheduler.schedule().scheduled
        assert step.num_new_tokens == seq.num_tokens - 4 * loaded
        scheduler.abort("r1")
        assert bm.num_free_blocks == 16
    finally:
        receiver.close()
        tiers.close()


def test_sequences_loaded_back_together_never_hold_the_pool_while_they_wait(plain_engine_outputs):
    """Three second turns arrive at once, each with 13 blocks below the pool: all three loads fit
    (39 of 40 blocks), and then each needs 11 blocks more. A loaded sequence waiting behind
    another must hold nothing, or the one at the head never fits: every turn must finish, with
    the tokens of an engine without tiers."""
    expected, prompts = plain_engine_outputs
    engine = make_engine(kv_host_bytes=1 << 20)
    try:
        outputs = run_together(engine, prompts)
        assert outputs == expected
        assert engine.tiers.stats.hit_blocks["host"] >= 3 * 12
        assert engine.block_manager.num_free_blocks == POOL
    finally:
        engine.close()


def run_together(engine: LLMEngine, prompts: list[list[int]], max_steps: int = 3000):
    """First turns one by one, other prompts evicting them, then every second turn at once."""
    firsts = conversations(3, 48, seed=21)
    answers = [run(engine, p, f"first-{i}")[0] for i, p in enumerate(firsts)]
    for i, other in enumerate(conversations(4, 60, seed=22)):
        run(engine, other, f"other-{i}")
    seqs = [
        engine.add_request(f"second-{i}", firsts[i] + answers[i] + prompts[i], GREEDY)
        for i in range(3)
    ]
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "the second turns never finished"
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def plain_engine_outputs() -> tuple[list[list[int]], list[list[int]]]:
    prompts = conversations(3, 40, seed=23)  # each second turn's new message
    engine = make_engine()
    try:
        return run_together(engine, prompts), prompts
    finally:
        engine.close()
