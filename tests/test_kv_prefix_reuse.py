"""Decode-side prefix reuse at the handoff, alone: real tcp transports in one process. A decode
node's reservation takes the leading full blocks its prefix cache holds (token ids verified),
the prefill side skips as many, the taken blocks cannot be evicted while reserved, and every
block comes back when the request ends."""

from __future__ import annotations

import pytest
import torch
from test_kv_handoff import BLOCKS, Sides

import pdserve.engine.kv.block_manager as block_manager_module
import pdserve.engine.kv.kv_manager as kv_manager_module
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

BS = 4  # the layout's block size
PARAMS = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture
def sides():
    s = Sides()
    yield s
    s.close()


def incoming(sides: Sides, request_id: str, prompt: list[int], reuse: bool = True):  # noqa: ANN201
    """A prefilled sequence admitted to the decode side: prompt computed, one token after it."""
    seq = Sequence(request_id, prompt, PARAMS)
    seq.token_ids.append(99)
    seq.num_computed_tokens = len(prompt)
    return seq, sides.decode.reserve(seq, 10.0, reuse_prefix=reuse)


def hand_off(sides: Sides, request_id: str, prompt: list[int], reuse: bool = True):  # noqa: ANN201
    """Prefill holds the prompt's blocks; the decode side reserves; the prefill side sends what
    the decode side does not hold. Returns (src blocks, seq, dst blocks) once it arrived."""
    src: list[int] = []
    assert sides.src_blocks.allocate_slots(src, len(prompt))
    sides.prefill.hold(request_id, [src])
    src = list(src)
    seq, dst = incoming(sides, request_id, prompt, reuse)
    skip = len(seq.block_table) - len(dst)
    sides.prefill.send(request_id, "d0", sides.receiver.info(), dst, 10, skip_blocks=skip)
    ends, arrived, failed = sides.run_until(lambda e, a, f: e and a)
    assert [(e.request_id, e.ok) for e in ends] == [(request_id, True)]
    assert arrived == [seq] and not failed
    assert sides.src_blocks.num_free_blocks == BLOCKS  # the prefill side let go
    return src, seq, dst


def pages(pool, block: int) -> torch.Tensor:  # noqa: ANN001
    return pool.kv[:, :, block]


def test_a_second_turn_receives_only_the_blocks_after_the_cached_prefix(sides):
    first = list(range(10, 20))  # 2 full blocks and a partial one
    _, seq1, dst1 = hand_off(sides, "t1", first)
    assert len(dst1) == 3 and sides.decode.blocks_received == 3
    # Turn 1 ends on the decode node: its full blocks stay cached.
    sides.dst_blocks.free(seq1.block_table)
    assert sides.dst_blocks.num_free_blocks == BLOCKS
    # Turn 2 = turn 1 + more: the reused prefix ends mid-block (10 tokens), so only the two
    # whole blocks are reused and the third (tokens 8..11, now different) is sent.
    second = first + [50, 51, 52, 53, 54]
    src2, seq2, dst2 = hand_off(sides, "t2", second)
    assert seq2.block_table[:2] == dst1[:2] and len(dst2) == 2
    assert sides.decode.blocks_reused == 2 and sides.decode.blocks_received == 5
    for s, d in zip(src2[2:], dst2):
        assert torch.equal(pages(sides.src_pool, s), pages(sides.receiver.pool, d))
    sides.dst_blocks.free(seq2.block_table)
    assert sides.dst_blocks.num_free_blocks == BLOCKS  # no leak


def test_a_fully_cached_prompt_moves_no_pages_and_still_completes(sides):
    prompt = list(range(30, 38))  # exactly 2 blocks
    _, seq1, _ = hand_off(sides, "t1", prompt)
    sides.dst_blocks.free(seq1.block_table)
    received = sides.decode.blocks_received
    _, seq2, dst2 = hand_off(sides, "t2", prompt)
    assert dst2 == [] and len(seq2.block_table) == 2 and seq2.num_cached_tokens == 8
    assert sides.decode.blocks_received == received  # nothing arrived, yet it is runnable
    sides.dst_blocks.free(seq2.block_table)
    assert sides.dst_blocks.num_free_blocks == BLOCKS


def test_lookup_compares_token_ids_never_the_hash_alone(sides, monkeypatch):
    # Every block hashes alike: the first prompt's blocks are cached under the one hash a
    # different prompt also looks up, and must not be handed out for it.
    for module in (block_manager_module, kv_manager_module):
        monkeypatch.setattr(module, "hash_block_tokens", lambda parent, tokens: 7)
    _, seq1, _ = hand_off(sides, "t1", list(range(10, 20)))
    sides.dst_blocks.free(seq1.block_table)
    assert sides.dst_blocks.num_cached_blocks == 1
    seq, dst = incoming(sides, "t2", list(range(100, 110)))
    assert len(dst) == 3 and seq.block_table == dst and sides.decode.blocks_reused == 0
    sides.decode.cancel("t2", kv_unsent=True)
    # The same prompt again does match (the lookup itself works under that hash).
    seq, dst = incoming(sides, "t3", list(range(10, 20)))
    assert len(dst) == 2 and sides.decode.blocks_reused == 1
    sides.decode.cancel("t3", kv_unsent=True)
    assert sides.dst_blocks.num_free_blocks == BLOCKS


def test_reused_blocks_are_not_evicted_while_reserved_and_all_return_after(sides):
    first = list(range(10, 22))  # 3 full blocks
    _, seq1, dst1 = hand_off(sides, "t1", first)
    sides.dst_blocks.free(seq1.block_table)  # cached, evictable
    seq2, dst2 = incoming(sides, "t2", first + [7])
    reused = seq2.block_table[:3]
    assert reused == dst1 and len(dst2) == 1
    # Fill the whole pool: eviction takes every other cached block, never the reserved ones.
    hog: list[int] = []
    assert sides.dst_blocks.allocate_slots(hog, sides.dst_blocks.num_free_blocks * BS)
    assert sides.dst_blocks.num_free_blocks == 0 and not set(hog) & set(seq2.block_table)
    assert all(sides.dst_blocks.ref_count(b) == 1 for b in reused)
    # An abort of the reservation (no KV was ever asked for) frees it at once: no leak.
    assert sides.decode.cancel("t2", kv_unsent=True)
    sides.dst_blocks.free(hog)
    assert sides.dst_blocks.num_free_blocks == BLOCKS and sides.decode.num_pending == 0


def test_an_abort_of_a_fully_cached_reservation_frees_it_at_once(sides):
    prompt = list(range(30, 38))
    _, seq1, _ = hand_off(sides, "t1", prompt)
    sides.dst_blocks.free(seq1.block_table)
    _, dst = incoming(sides, "t2", prompt)
    assert dst == [] and sides.dst_blocks.num_free_blocks == BLOCKS - 2
    assert sides.decode.cancel("t2")  # even with a sender told: nothing can write into it
    assert sides.dst_blocks.num_free_blocks == BLOCKS and sides.decode.num_pending == 0
    assert sides.decode.poll() == ([], [])


def test_without_reuse_every_block_is_received(sides):
    prompt = list(range(10, 20))
    _, seq1, _ = hand_off(sides, "t1", prompt, reuse=False)
    sides.dst_blocks.free(seq1.block_table)
    _, seq2, dst2 = hand_off(sides, "t2", prompt + [1, 2], reuse=False)
    assert len(dst2) == 3 and sides.decode.blocks_reused == 0
    assert sides.decode.blocks_received == 6
    sides.dst_blocks.free(seq2.block_table)
    assert sides.dst_blocks.num_free_blocks == BLOCKS


def test_a_send_whose_skip_does_not_match_the_destination_fails_and_frees(sides):
    src: list[int] = []
    assert sides.src_blocks.allocate_slots(src, 10)
    sides.prefill.hold("r1", [src])
    sides.prefill.send("r1", "d0", sides.receiver.info(), [1, 2], 10, skip_blocks=2)
    (end,) = sides.prefill.poll()
    assert not end.ok and "skipped" in end.error
    assert sides.src_blocks.num_free_blocks == BLOCKS
