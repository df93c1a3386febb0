"""KV tiers and block accounting under linear-attention hybrids (tests/checkpoints.py: Qwen3.5,
one full layer to one Gated DeltaNet layer; Qwen3.5-MoE and Qwen3-Next, one to three). A
conversation's first turn leaves a small pool; its second turn comes back from the host tier,
or from disk, each full group loading every block of the hit and each linear group one, the
state snapshot at the hit's last block, with the tokens of an engine without tiers (which are
transformers'); a corrupt snapshot on disk is computed instead, with the same tokens; the
coordinator's prefix index, fed by the node's KV events, counts the prefix the node then loads.
On a pool small enough to preempt, with requests aborted mid-prefill, mid-decode and while
their prefix loads, every block comes back and the finished requests keep their tokens. Where
only every third block boundary's state is kept, the tiers hold those and a hit ends on one."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_kv_tiers_windowed import loaded_per_group, recording_finds
from waiting import WAIT_S

from pdserve.cluster.block_hash import group_hash, prefix_hashes
from pdserve.cluster.kv_event_stream import KVEventStream
from pdserve.coordinator.prefix_index import PrefixIndex, PrefixMatch
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm_engine import Engine
from pdserve.engine.sequence import Sequence

BLOCK = 4  # asked for; the engine raises it to 12, the first multiple whose page holds a state
# The sampled tokens' logprobs as well: a state restored wrong may leave a tiny model's greedy
# tokens as they were, not their logprobs.
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
LOGPROB_TOLERANCE = 1e-4  # a state restored, not recomputed: float32 sums in another order (4e-6)
# Pools that hold one conversation's turns, not the prompts after them (blocks of every group).
POOLS = {"qwen3_5_text": 24, "qwen3_5_moe_text": 32, "qwen3_next": 32}
# The second turn (91 tokens) finds its first turn's 7 full blocks of 12 below the pool: the
# full group loads all 7, each linear group the one holding its state after token 83.
HIT = 7
LOADED_PER_GROUP = {
    "qwen3_5_text": [HIT, 1],
    "qwen3_5_moe_text": [HIT, 1, 1, 1],
    "qwen3_next": [HIT, 1, 1, 1],
}
FIRST, EVICTING = 80, [80, 80, 80, 80]  # prompt lengths


def prompts(seed: int = 5) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    first = [rng.randrange(4, 500) for _ in range(FIRST)]
    return first, [[rng.randrange(4, 500) for _ in range(n)] for n in EVICTING]


def make_llm(model_dir: Path, family: str, **options: object) -> LLM:
    return LLM(
        str(model_dir),
        block_size=BLOCK,
        num_kv_blocks=POOLS[family],
        max_num_batched_tokens=16,
        device="cpu",
        **options,
    )


def logprobs(seq: Sequence) -> list[float]:
    """The sampled tokens' logprobs."""
    return [lp["token"][1] for lp in seq.output_logprobs]


def assert_same_outputs(seqs: list[Sequence], expected: list[Sequence]) -> None:
    """The same tokens, and logprobs within float32's reordering."""
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in expected]
    for seq, other in zip(seqs, expected):
        assert logprobs(seq) == pytest.approx(logprobs(other), abs=LOGPROB_TOLERANCE)


def drain(llm: LLM) -> None:
    """Step until nothing is left: requests, or copies to or from the tiers. A block lost
    (a pool that never again admits what waits) fails rather than steps forever."""
    deadline = time.monotonic() + WAIT_S
    while llm.engine.has_unfinished():
        if time.monotonic() > deadline:
            raise AssertionError(f"work left after {WAIT_S:g} s: {llm.engine.load()}")
        llm.engine.step()


def run(llm: LLM, prompt: list[int], request_id: str) -> Sequence:
    """The request run to its end, alone: its sequence (tokens, logprobs, cached tokens)."""
    seq = llm.engine.add_request(request_id, prompt, GREEDY)
    drain(llm)
    return seq


def first_turn(llm: LLM) -> tuple[list[int], list[Sequence]]:
    """The first turn, then prompts that evict it from the pool; (the second turn's prompt,
    every sequence so far)."""
    first, others = prompts()
    seqs = [run(llm, first, "first")]
    seqs += [run(llm, p, f"other-{i}") for i, p in enumerate(others)]
    return first + seqs[0].output_token_ids + [11, 12, 13], seqs


def held_in_pool(llm: LLM, tokens: list[int]) -> int:
    """How many of the tokens' full blocks, in any group, the pool's prefix cache holds."""
    engine = llm.engine
    bm, bs = engine.block_manager, engine.layout.block_size
    hashes = prefix_hashes(tokens, bs)
    held = 0
    for i, h in enumerate(hashes):
        key = (hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]))
        for g in range(engine.layout.groups.num_groups):
            held += bm.cached_block(group_hash(h, g), key) is not None
    return held


def coordinators_match(stream: KVEventStream, engine: Engine, tokens: list[int]) -> PrefixMatch:
    """The prefix of tokens that a coordinator's index, fed every KV event the node logged
    since the stream started, finds on the node."""
    index = PrefixIndex()
    index.register("node", stream.restart())
    while stream.log:
        ack = index.apply("node", *stream.report())
        if ack is not None:
            stream.acknowledged(ack)
    bs = engine.layout.block_size
    return index.match("node", index.prompt_hashes(tokens, bs), engine.layout.groups, bs)


@pytest.fixture(scope="module")
def plain(checkpoint_dir):
    """family -> (the second turn's prompt, every sequence of an engine without tiers, the
    bytes of a block, the block size); their tokens are transformers' greedy ones."""
    from checkpoints import hf_greedy

    cache = {}

    def get(family: str):
        if family not in cache:
            model_dir = checkpoint_dir(family)
            llm = make_llm(model_dir, family)
            layout = llm.engine.layout
            assert [g.kind.label for g in layout.groups.groups][0] == "full"
            with llm:
                second, seqs = first_turn(llm)
                seqs.append(run(llm, second, "second"))
                assert seqs[-1].num_cached_tokens == 0  # the pool evicted the first turn
            first, others = prompts()
            hf = hf_greedy(model_dir, [first, *others, second], GREEDY.max_tokens)
            assert hf == [s.output_token_ids for s in seqs]
            cache[family] = (second, seqs, layout.bytes_per_block, layout.block_size)
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(LOADED_PER_GROUP))
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_evicted_prefix_comes_back_with_one_state_snapshot_per_linear_group(
    family, tier, plain, checkpoint_dir, tmp_path
):
    second, expected, bpb, bs = plain(family)
    assert bs == 12 and len(second) == 91
    options: dict[str, object] = {"kv_host_bytes": 1 << 22}
    if tier == "disk":  # a host tier of 8 blocks: the first turn's left it for the disk
        options = {"kv_host_bytes": 8 * bpb, "kv_disk_path": str(tmp_path)}
    with make_llm(checkpoint_dir(family), family, **options) as llm:
        engine = llm.engine
        stream = KVEventStream(engine.enable_kv_events())
        finds = recording_finds(engine.tiers)
        _, seqs = first_turn(llm)
        drain(llm)
        assert held_in_pool(llm, second) == 0
        # What the node's events told the coordinator: the first turn's 7 blocks, each position
        # read below the pool by the full group (a linear group reads the last one only).
        match = coordinators_match(stream, engine, second)
        assert match.blocks == HIT and match.by_tier[tier] == HIT
        groups = engine.layout.groups

        finds.clear()
        seqs.append(run(llm, second, "second"))
        assert_same_outputs(seqs, expected)
        assert seqs[-1].num_cached_tokens == HIT * bs
        (load,) = finds
        assert load.prefix.num_blocks == HIT
        loaded = loaded_per_group(load, groups.num_groups)
        assert loaded == LOADED_PER_GROUP[family]
        # Each linear group's one block is the snapshot at the hit's last block.
        assert [i for i, g in load.prefix.places if g > 0] == [HIT - 1] * (len(loaded) - 1)
        stats = engine.tiers.stats
        assert stats.hit_blocks[tier] == sum(loaded) and stats.failures == 0
        assert stats.loaded_bytes[tier] == stats.hit_blocks[tier] * bpb
        drain(llm)
        assert engine.block_manager.num_free_blocks == POOLS[family]  # every block back


def test_at_an_interval_of_three_the_tiers_hold_every_third_state_and_a_hit_ends_on_one(
    plain, checkpoint_dir
):
    family = "qwen3_5_text"
    second, expected, _, bs = plain(family)
    with make_llm(
        checkpoint_dir(family), family, kv_host_bytes=1 << 22, linear_snapshot_interval=3
    ) as llm:
        engine = llm.engine
        stream = KVEventStream(engine.enable_kv_events())
        finds = recording_finds(engine.tiers)
        _, seqs = first_turn(llm)
        drain(llm)
        assert held_in_pool(llm, second) == 0
        # The first turn's 7 blocks of the full group went down, and its states after blocks
        # 2 and 5: a hit of 6 blocks, as the coordinator finds it.
        hashes, below = prefix_hashes(second, bs), set(engine.tiers.hashes()["host"])
        assert all(group_hash(hashes[i], 0) in below for i in range(HIT))
        assert [i for i in range(HIT) if group_hash(hashes[i], 1) in below] == [2, 5]
        match = coordinators_match(stream, engine, second)
        assert match.blocks == 6 and match.by_tier["host"] == 6
        finds.clear()
        seqs.append(run(llm, second, "second"))
        assert_same_outputs(seqs, expected)
        assert seqs[-1].num_cached_tokens == 6 * bs
        (load,) = finds
        assert loaded_per_group(load, 2) == [6, 1] and load.prefix.places[-1] == (5, 1)
        drain(llm)
        assert engine.block_manager.num_free_blocks == POOLS[family]


def test_a_corrupt_state_snapshot_on_disk_is_computed_with_the_same_tokens(
    plain, checkpoint_dir, tmp_path
):
    family = "qwen3_next"
    second, expected, bpb, bs = plain(family)
    with make_llm(
        checkpoint_dir(family), family, kv_host_bytes=8 * bpb, kv_disk_path=str(tmp_path)
    ) as llm:
        engine = llm.engine
        finds = recording_finds(engine.tiers)
        _, seqs = first_turn(llm)
        drain(llm)
        # Corrupt the file of the first linear group's snapshot after block 6, the hit's last.
        path = Path(engine.tiers.disk.file(group_hash(prefix_hashes(second, bs)[HIT - 1], 1)))
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        finds.clear()
        seqs.append(run(llm, second, "second"))
        assert_same_outputs(seqs, expected)
        assert engine.tiers.stats.failures == 1
        # The load stopped at that block (after the full group's 7): without that group's
        # state after block 6 the admission looked below again and found the prefix of 6
        # blocks, whose full blocks the pool now holds and whose states after block 5 each
        # linear group loads. Block 6 on was computed, in every group.
        assert [loaded_per_group(f, 4) for f in finds] == [[HIT, 1, 1, 1], [0, 1, 1, 1]]
        assert seqs[-1].num_cached_tokens == (HIT - 1) * bs
        drain(llm)
        assert engine.block_manager.num_free_blocks == POOLS[family]


def test_a_request_aborted_while_its_snapshot_loads_gives_back_every_block(plain, checkpoint_dir):
    family = "qwen3_5_text"
    second, expected, _, _ = plain(family)
    with make_llm(checkpoint_dir(family), family, kv_host_bytes=1 << 22) as llm:
        engine = llm.engine
        first_turn(llm)
        drain(llm)
        engine.add_request("second", second, GREEDY)
        engine.step()  # the lookup found the prefix below: its blocks are loading
        assert list(engine.scheduler.loading) == ["second"]
        assert engine.block_manager.num_free_blocks == POOLS[family] - sum(LOADED_PER_GROUP[family])
        assert engine.abort("second")
        drain(llm)
        assert engine.block_manager.num_free_blocks == POOLS[family]
        # The blocks it loaded entered the prefix cache: the turn asked again hits them.
        again = run(llm, second, "again")
        assert_same_outputs([again], expected[-1:])
        assert again.num_cached_tokens == HIT * engine.layout.block_size


# --- finish, abort and preemption on a pool that runs short ------------------------------------

FAMILY = "qwen3_5_text"
LONG = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
# Two of them to abort: the longest mid-prefill (chunks of 16), another mid-decode.
LENGTHS = [30, 70, 45, 100, 20, 60, 90]
MID_PREFILL, MID_DECODE = "r3", "r1"
SMALL_POOL = 20  # of 12-token blocks: the longest sequence's 13 at most, not the batch's


def batch_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(4, 500) for _ in range(n)] for n in LENGTHS]


def add_batch(llm: LLM) -> dict[str, Sequence]:
    engine = llm.engine
    return {f"r{i}": engine.add_request(f"r{i}", p, LONG) for i, p in enumerate(batch_prompts())}


@pytest.fixture(scope="module")
def unconstrained(checkpoint_dir) -> dict[str, Sequence]:
    """Every request run on a pool that holds them all, in one prefill each."""
    llm = LLM(str(checkpoint_dir(FAMILY)), block_size=BLOCK, num_kv_blocks=300, device="cpu")
    seqs = add_batch(llm)
    drain(llm)
    assert llm.engine.scheduler.num_preemptions == 0
    return seqs


def step_until(llm: LLM, condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        llm.engine.step()
    raise AssertionError(f"500 steps and no {what}")


@pytest.mark.parametrize("interval", [1, 3])
def test_every_block_comes_back_after_finish_abort_and_preemption(
    interval, unconstrained, checkpoint_dir
):
    llm = LLM(
        str(checkpoint_dir(FAMILY)),
        block_size=BLOCK,
        num_kv_blocks=SMALL_POOL,
        max_num_batched_tokens=16,
        linear_snapshot_interval=interval,
        device="cpu",
    )
    engine = llm.engine
    seqs = add_batch(llm)
    mid_prefill, mid_decode = seqs[MID_PREFILL], seqs[MID_DECODE]

    def prefilling() -> bool:
        return 0 < mid_prefill.num_computed_tokens < mid_prefill.num_prompt_tokens

    step_until(llm, prefilling, f"{MID_PREFILL} part-prefilled")
    assert engine.abort(MID_PREFILL)
    step_until(llm, lambda: mid_decode.num_output_tokens >= 3, f"{MID_DECODE} decoding")
    assert not mid_decode.is_finished
    assert engine.abort(MID_DECODE)
    drain(llm)
    bm = engine.block_manager
    # Preempted, they came back from the state snapshots they had left in the pool.
    assert engine.scheduler.num_preemptions > 0 and bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_blocks == SMALL_POOL
    assert [s.finish_reason for s in (mid_prefill, mid_decode)] == ["abort", "abort"]
    finished = [rid for rid in seqs if rid not in (MID_PREFILL, MID_DECODE)]
    assert {seqs[rid].finish_reason for rid in finished} == {"length"}
    assert_same_outputs([seqs[r] for r in finished], [unconstrained[r] for r in finished])


def test_a_snapshot_interval_of_three_hits_on_a_kept_boundary_with_the_same_tokens(
    checkpoint_dir,
):
    rng = random.Random(13)
    first = [rng.randrange(4, 500) for _ in range(100)]
    # Shares 7 blocks and 4 tokens of the first, whose states are kept after blocks 2 and 5
    # (and 8) at an interval of 3, after every block at 1.
    second = first[:88] + [rng.randrange(4, 500) for _ in range(20)]
    seqs = {}
    for interval in (1, 3):
        with LLM(
            str(checkpoint_dir(FAMILY)),
            block_size=BLOCK,
            num_kv_blocks=60,
            linear_snapshot_interval=interval,
            device="cpu",
        ) as llm:
            seqs[interval] = [run(llm, first, "first"), run(llm, second, "second")]
            assert llm.engine.block_manager.num_free_blocks == 60
            bs = llm.engine.layout.block_size
    assert [seqs[i][1].num_cached_tokens for i in (1, 3)] == [7 * bs, 6 * bs]
    assert_same_outputs(seqs[3], seqs[1])
