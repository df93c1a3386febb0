"""KV tiers under models with windowed or chunked layers (tests/checkpoints.py: Qwen2 with one full
layer and two 12-token windows, Gemma 3 with one full layer and six 8-token windows, Llama 4 with
one full layer and three of 8-token chunks, Mistral windowed on every layer). A conversation's
first turn leaves a small pool; its second turn comes back from the host tier, or from disk, each
group loading only the blocks its next query reads (a full group every block, a windowed one its
window's), with the tokens of an engine without tiers; a corrupt disk block is computed instead,
with the same tokens; every block comes back; the coordinator's prefix index, fed by the node's
KV events, counts the prefix the node then loads. Without a model: the hit's decisions against a
brute force, and a decode node's handoff loading each group's blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.block_hash import group_hash, prefix_hashes
from pdserve.cluster.kv_event_stream import KVEventStream
from pdserve.cluster.sampling_params import SamplingParams as Params
from pdserve.coordinator.prefix_index import PrefixIndex
from pdserve.decode_node.handoff import DecodeHandoff
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.kv.disk_tier import DiskTier
from pdserve.engine.kv.groups import KVGroups
from pdserve.engine.kv.host_tier import HostTier
from pdserve.engine.kv.kv_manager import FREED, KVCacheManager
from pdserve.engine.kv.layer_kinds import ChunkedLocal, FullAttention, SlidingWindow
from pdserve.engine.kv.tiers import KVTiers
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import make_receiver

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Pools that hold one conversation's turns, not the prompts after them (blocks of every group).
POOLS = {"qwen2_sliding": 48, "gemma3_text": 80, "mistral_sliding": 24, "llama4_text": 48}
# The second turn (71 tokens) finds its first turn's 16 full blocks below the pool: the full
# group loads all 16, a group of 12-token windows the 3 its query at position 64 reads (53..64),
# one of 8-token windows 2 (57..64), one of 8-token chunks none (its query starts a chunk).
LOADED_PER_GROUP = {
    "qwen2_sliding": [16, 3, 3],
    "gemma3_text": [16, 2, 2, 2, 2, 2, 2],
    "mistral_sliding": [3],
    "llama4_text": [16, 0, 0, 0],
}
FIRST, EVICTING = 60, [60, 60, 60, 60]  # prompt lengths


def prompts(seed: int = 3) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    first = [rng.randrange(4, 500) for _ in range(FIRST)]
    return first, [[rng.randrange(4, 500) for _ in range(n)] for n in EVICTING]


def make_llm(model_dir: Path, family: str, **tiers: object) -> LLM:
    # Chunks of 16 tokens: a window's blocks go back during the prefill, so the pool stays small.
    return LLM(
        str(model_dir),
        block_size=BLOCK,
        num_kv_blocks=POOLS[family],
        max_num_batched_tokens=16,
        device="cpu",
        **tiers,
    )


def run(llm: LLM, prompt: list[int], request_id: str) -> tuple[list[int], int]:
    engine = llm.engine
    seq = engine.add_request(request_id, prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids, seq.num_cached_tokens


def first_turn(llm: LLM) -> tuple[list[int], list[list[int]]]:
    """The first turn, then prompts that evict it from the pool; (the second turn's prompt,
    every output so far)."""
    first, others = prompts()
    outputs = [run(llm, first, "first")[0]]
    outputs += [run(llm, p, f"other-{i}")[0] for i, p in enumerate(others)]
    return first + outputs[0] + [11, 12, 13], outputs


def recording_finds(tiers: KVTiers) -> list:
    """Every TierLoad the engine's lookups find, as they find them."""
    found = []
    find = tiers.find

    def record(*args):
        found.append(find(*args))
        return found[-1]

    tiers.find = record
    return found


def loaded_per_group(load, num_groups: int) -> list[int]:
    return [sum(g == group for _, g in load.prefix.places) for group in range(num_groups)]


def held_in_pool(llm: LLM, tokens: list[int]) -> int:
    """How many of the tokens' full blocks, in any group, the pool's prefix cache holds."""
    bm, engine = llm.engine.block_manager, llm.engine
    hashes = prefix_hashes(tokens, BLOCK)
    held = 0
    for i, h in enumerate(hashes):
        key = (hashes[i - 1] if i else None, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        for g in range(engine.layout.groups.num_groups):
            held += bm.cached_block(group_hash(h, g), key) is not None
    return held


@pytest.fixture(scope="module")
def plain(checkpoint_dir):
    """family -> (the second turn's prompt, every output of an engine without tiers, the bytes
    of a block)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            llm = make_llm(checkpoint_dir(family), family)
            with llm:
                second, outputs = first_turn(llm)
                out, cached = run(llm, second, "second")
                assert cached == 0  # the pool evicted the first turn
            cache[family] = (second, outputs + [out], llm.engine.layout.bytes_per_block)
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(LOADED_PER_GROUP))
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_windowed_model_s_evicted_prefix_comes_back_per_group_with_the_same_tokens(
    family, tier, plain, checkpoint_dir, tmp_path
):
    second, expected, bpb = plain(family)
    options: dict[str, object] = {"kv_host_bytes": 1 << 22}
    if tier == "disk":  # a host tier of 8 blocks: the first turn's left it for the disk
        options = {"kv_host_bytes": 8 * bpb, "kv_disk_path": str(tmp_path)}
    with make_llm(checkpoint_dir(family), family, **options) as llm:
        engine = llm.engine
        stream, index = KVEventStream(engine.enable_kv_events()), PrefixIndex()
        index.register("node", stream.restart())
        finds = recording_finds(engine.tiers)
        _, outputs = first_turn(llm)
        while engine.has_unfinished():  # the last copies down
            engine.step()
        assert held_in_pool(llm, second) == 0
        while stream.log:
            ack = index.apply("node", *stream.report())
            if ack is not None:
                stream.acknowledged(ack)
        # What the node's events told the coordinator: a prefix of the first turn's 16 blocks,
        # the positions some group reads below the pool (the rest cost nothing to take).
        groups = engine.layout.groups
        match = index.match("node", index.prompt_hashes(second, BLOCK), groups, BLOCK)
        assert match.blocks == 16 and match.by_tier[tier] == max(LOADED_PER_GROUP[family])

        finds.clear()
        out, cached = run(llm, second, "second")
        assert outputs + [out] == expected
        assert cached == 16 * BLOCK
        load = finds[0]
        assert load.prefix.num_blocks == 16
        assert loaded_per_group(load, engine.layout.groups.num_groups) == LOADED_PER_GROUP[family]
        stats = engine.tiers.stats
        assert stats.hit_blocks[tier] == sum(LOADED_PER_GROUP[family]) and stats.failures == 0
        assert stats.loaded_bytes[tier] == stats.hit_blocks[tier] * bpb
        while engine.has_unfinished():
            engine.step()
        assert engine.block_manager.num_free_blocks == POOLS[family]  # every block back


def test_a_corrupt_disk_block_of_a_window_is_computed_with_the_same_tokens(
    plain, checkpoint_dir, tmp_path
):
    family = "qwen2_sliding"
    second, expected, bpb = plain(family)
    with make_llm(
        checkpoint_dir(family), family, kv_host_bytes=8 * bpb, kv_disk_path=str(tmp_path)
    ) as llm:
        engine = llm.engine
        finds = recording_finds(engine.tiers)
        _, outputs = first_turn(llm)
        while engine.has_unfinished():
            engine.step()
        # Corrupt the file of the first windowed group's block 13, the first its window loads.
        disk = engine.tiers.disk
        path = Path(disk.file(group_hash(prefix_hashes(second, BLOCK)[13], 1)))
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        finds.clear()
        out, cached = run(llm, second, "second")
        assert outputs + [out] == expected
        assert engine.tiers.stats.failures == 1
        # The load stopped at that block (after the full group's block 13); the admission looked
        # below again and found the prefix up to it: 13 blocks, each window loading the 3 blocks
        # its query at position 52 reads (41..52). Block 13 on was computed, in every group.
        assert [loaded_per_group(f, 3) for f in finds] == [[16, 3, 3], [0, 3, 3]]
        assert cached == 13 * BLOCK
        while engine.has_unfinished():
            engine.step()
        assert engine.block_manager.num_free_blocks == POOLS[family]


# --- without a model: the hit's decisions, and a decode node's handoff --------------------------

W8, FULL = SlidingWindow(8), FullAttention()


def seq_of(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, tokens, Params(max_tokens=4, temperature=0))


def computed(kv: KVCacheManager, tokens: list[int]) -> Sequence:
    """A sequence whose tokens' KV is computed and registered, its unread blocks given back."""
    seq = seq_of(tokens, "first")
    assert kv.allocate_slots(seq, len(tokens), 0)
    seq.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(seq)
    kv.release_unread(seq)
    return seq


def below(tokens: list[int], groups: int) -> set[int]:
    """Every full block's key in every group: what write-through leaves in the tiers."""
    return {group_hash(h, g) for h in prefix_hashes(tokens, BLOCK) for g in range(groups)}


def test_a_hit_below_takes_the_pool_s_blocks_and_loads_only_what_the_groups_lack():
    bm = BlockManager(20, BLOCK)  # the prompt's 10 blocks in each group: none on the free list
    kv = KVCacheManager(bm, KVGroups.for_layers([W8, FULL]))  # group 0 full, group 1 windowed
    prompt = list(range(10, 50))  # 10 blocks
    kv.free(computed(kv, prompt))
    # The window group's blocks 8 and 9 leave the pool (the tiers keep them): the pool's own
    # hit ends at 8 blocks, whose window (25..32) it holds.
    hashes, evicted = prefix_hashes(prompt, BLOCK), []
    for i in (8, 9):
        key = (hashes[i - 1], tuple(prompt[i * BLOCK : (i + 1) * BLOCK]))
        block = bm.cached_block(group_hash(hashes[i], 1), key)
        bm._evictable.move_to_end(block, last=False)
        evicted.append(bm.allocate_one())
        assert evicted[-1] == block
    seq = seq_of(prompt + [1], "again")
    assert kv.allocate_prefix(seq) == 8 * BLOCK
    full_blocks = list(seq.block_table)
    keys = below(prompt, 2)
    load = kv.find_below(seq, seq.num_tokens, lambda h, key: h in keys)
    # All 10 blocks: the full group's from the pool, the window's last two loaded.
    assert load.num_blocks == 10 and load.places == [(8, 1), (9, 1)]
    assert kv.allocate_load(seq, load)
    table, window = seq.block_tables
    assert table[:8] == full_blocks and FREED not in table
    assert window[:8] == [FREED] * 8 and window[8:] == load.blocks
    assert kv.cache_loaded(seq, load, 2) == 10
    kv.free(seq)
    again = seq_of(prompt + [1], "third")
    assert kv.allocate_prefix(again) == 10 * BLOCK  # the loaded blocks are in the prefix cache
    kv.free(again)
    bm.free(evicted)
    assert bm.num_free_blocks == bm.num_blocks


LAYOUT = KVLayout(2, BLOCK, 2, 8, "float32", layer_kinds=("sliding 8", "full"))


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_handoff_loads_each_group_s_blocks_from_the_tiers_and_computes_what_failed(
    corrupt, tmp_path
):
    groups = LAYOUT.groups  # group 0: layer 1, full; group 1: layer 0, an 8-token window
    bm, pool = BlockManager(24, BLOCK), KVPool(LAYOUT, 24)
    pool.kv.copy_(torch.randn_like(pool.kv))
    kv = KVCacheManager(bm, groups)
    host = HostTier(LAYOUT, 2 * LAYOUT.bytes_per_block)  # 2 blocks: the others only on disk
    tiers = KVTiers(pool, bm, host, DiskTier(LAYOUT, str(tmp_path), 1 << 20))
    prompt = list(range(40, 61))  # 21 tokens: 5 full blocks of KV, then the last token's
    first = seq_of(prompt[:20], "first")
    assert kv.allocate_slots(first, 20, 0)
    first.num_computed_tokens = 20
    kv.cache_full_blocks(first)
    pages = [pool.kv[:, :, table].clone() for table in first.block_tables]
    kv.release_unread(first)
    tiers.store_new()
    while tiers.busy:
        tiers.wait(1.0)
        tiers.poll()
    assert tiers.disk.num_blocks == 10  # both groups' 5 blocks
    kv.free(first)
    bm.reset_prefix_cache()  # out of the pool: below it alone
    pool.kv.zero_()
    if corrupt:  # the window's block 4, the last the load reads
        path = Path(tiers.disk.file(group_hash(prefix_hashes(prompt, BLOCK)[4], 1)))
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    receiver = make_receiver("tcp", LAYOUT, 24)
    try:
        handoff = DecodeHandoff(receiver, bm, tiers=tiers, kv=kv)
        seq = seq_of(prompt)
        seq.token_ids.append(99)  # the first token, sampled by the prefill node
        seq.num_computed_tokens = 20  # the decode node computes the last prompt token's KV
        assert handoff.reserve(seq, 10.0, reuse_prefix=True) == []  # nothing to receive
        arrived = []
        while not arrived:
            tiers.wait(1.0)
            tiers.poll()
            arrived, _ = handoff.poll()
        assert arrived == [seq] and tiers.stats.failures == int(corrupt)
        # The full group loaded its 5 blocks, the window the 2 its query at 20 reads (13..20).
        assert tiers.stats.hit_blocks["host"] + tiers.stats.hit_blocks["disk"] == 7
        if corrupt:
            # Without the window's block 4 no prefix has its window whole: all computed here.
            assert seq.num_computed_tokens == 0 and seq.block_tables == [[], []]
        else:
            assert seq.num_computed_tokens == 20
            table, window = seq.block_tables
            assert window[:3] == [FREED] * 3
            assert torch.equal(pool.kv[:, :, table], pages[0])
            assert torch.equal(pool.kv[:, :, window[3:]], pages[1][:, :, 3:])
        scheduler = Scheduler(bm, 4, 64, kv_groups=groups)
        scheduler.add_running(seq)
        (step,) = scheduler.schedule().scheduled
        assert step.num_new_tokens == seq.num_tokens - seq.num_computed_tokens
        scheduler.abort(seq.request_id)
        assert bm.num_free_blocks == 24
    finally:
        receiver.close()
        tiers.close()


@st.composite
def pools_and_tiers(draw):
    """Layer kinds, a block size, a computed prompt, which of its blocks (group, position) left
    the pool, and which of them the tiers below still hold."""
    window, chunk = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    kinds = draw(
        st.sampled_from(
            [
                [FULL],
                [SlidingWindow(window)],
                [SlidingWindow(window), FULL],
                [ChunkedLocal(chunk), FULL, ChunkedLocal(chunk)],
                [SlidingWindow(window), FULL, ChunkedLocal(chunk)],
            ]
        )
    )
    block_size = draw(st.integers(2, 5))
    length = draw(st.integers(block_size, 40))
    groups = KVGroups.for_layers(kinds)
    every = [(g, i) for g in range(groups.num_groups) for i in range(length // block_size)]
    evicted = draw(st.sets(st.sampled_from(every))) if every else set()
    below = draw(st.sets(st.sampled_from(sorted(evicted)))) if evicted else set()
    failed_at = draw(st.integers(0, len(every)))
    return groups, block_size, length, evicted, below, failed_at


def longest(kinds, block_size: int, limit: int, held) -> int:
    """The longest prefix (blocks) whose every group holds what its next query reads."""
    for n in range(limit, 0, -1):
        if all(
            held(g, i)
            for g, kind in enumerate(kinds)
            for i in range(kind.first_read(n * block_size) // block_size, n)
        ):
            return n
    return 0


@settings(max_examples=300, deadline=None)
@given(pools_and_tiers())
def test_a_hit_below_is_the_longest_every_group_can_serve_from_the_pool_and_the_tiers(case):
    groups, bs, length, evicted, below, failed_at = case
    kinds = [g.kind for g in groups.groups]
    num_full = length // bs
    bm = BlockManager(groups.num_groups * num_full, bs)  # the prompt fills it: none free
    kv = KVCacheManager(bm, groups)
    prompt = list(range(100, 100 + length))
    kv.free(computed(kv, prompt[: num_full * bs]))
    hashes = prefix_hashes(prompt, bs)

    def key(i: int):
        return (hashes[i - 1] if i else None, tuple(prompt[i * bs : (i + 1) * bs]))

    taken = []
    for g, i in sorted(evicted):  # out of the pool
        block = bm.cached_block(group_hash(hashes[i], g), key(i))
        bm._evictable.move_to_end(block, last=False)
        taken.append(bm._allocate_fresh())
        assert taken[-1] == block
    bm.free(taken)
    keys = {group_hash(hashes[i], g) for g, i in below}
    seq = seq_of(prompt + [1], "again")
    cached = kv.allocate_prefix(seq) // bs
    load = kv.find_below(seq, seq.num_tokens, lambda h, k: h in keys)

    n = longest(kinds, bs, num_full, lambda g, i: (g, i) not in evicted or (g, i) in below)
    assert load.num_blocks == n >= cached == load.num_cached
    assert load.places == sorted(
        (i, g)
        for g, kind in enumerate(kinds)
        for i in range(kind.first_read(n * bs) // bs, n)
        if (g, i) in evicted
    )
    assert kv.allocate_load(seq, load)
    for kind, table in zip(kinds, seq.block_tables):
        first = kind.first_read(n * bs) // bs
        assert len(table) == n and table[:first] == [FREED] * first and FREED not in table[first:]
    # The load fails at a block (or none): what the tables still serve, and the pool after.
    failed_at = min(failed_at, len(load.places))
    served = kv.cache_loaded(seq, load, failed_at)
    tables = seq.block_tables
    assert served == longest(kinds, bs, n, lambda g, i: tables[g][i] != FREED)
    if failed_at < len(load.places):
        assert served <= load.places[failed_at][0]
    else:
        assert served == n
    kv.free(seq)
    again = seq_of(prompt + [1], "third")
    assert kv.allocate_prefix(again) >= served * bs
    kv.free(again)
    assert bm.num_free_blocks == bm.num_blocks
