"""Linear-attention layers' states in the KV pool, without a model: a linear group holds one
block per sequence (the one its next token reads the state from), the blocks it leaves behind
are snapshots at their boundaries that a prefix hit restores, a handoff moves the state once,
and a state laid into pages comes back whole, on every tensor-parallel rank by its heads."""

from __future__ import annotations

import pytest
import torch

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.groups import KVGroups, groups_for
from pdserve.engine.kv.kv_manager import FREED, KVCacheManager, handoff_blocks
from pdserve.engine.kv.layer_kinds import FullAttention, LinearState, parse_kind
from pdserve.engine.kv.state_pages import LinearStateShape, fitted_block_size
from pdserve.engine.models.config import LinearAttention, ModelConfig
from pdserve.engine.sequence import Sequence

FULL, LINEAR = FullAttention(), LinearState()
HYBRID = [LINEAR, LINEAR, LINEAR, FULL] * 2  # Qwen3.5's three DeltaNet layers to one attention


def seq_of(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=1000, ignore_eos=True))


def compute(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> None:
    """One step computing seq's tokens up to num_tokens, as the scheduler runs it."""
    assert kv.allocate_slots(seq, num_tokens, seq.num_computed_tokens)
    seq.num_computed_tokens = num_tokens
    kv.cache_full_blocks(seq)
    kv.release_unread(seq)


def test_linear_layers_form_groups_of_the_attention_layers_size():
    groups = KVGroups.for_layers(HYBRID)
    assert groups.groups[0].kind == FULL and groups.groups[0].layers == (3, 7)
    assert [g.layers for g in groups.groups[1:]] == [(0, 1), (2, 4), (5, 6)]
    assert groups.num_slots == 2
    assert parse_kind("linear") == LINEAR and LINEAR.label == "linear"
    assert groups_for(8, tuple(k.label for k in HYBRID)) == groups


@pytest.mark.parametrize("block_size", [4, 5])
def test_a_linear_group_holds_the_block_of_the_last_computed_token_only(block_size):
    bm = BlockManager(100, block_size)
    kv = KVCacheManager(bm, KVGroups.for_layers([LINEAR, FULL]))
    seq = seq_of(list(range(23)))
    compute(kv, seq, 23)
    for _ in range(30):  # decode steps, crossing block boundaries
        seq.append_token(9)
        compute(kv, seq, seq.num_tokens)
        full, linear = seq.block_tables
        assert FREED not in full
        held = [i for i, b in enumerate(linear) if b != FREED]
        # The next query (at num_computed) reads the state after the token before it.
        assert held == [(seq.num_computed_tokens - 1) // block_size]
    kv.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def finished_prompt(kv: KVCacheManager, tokens: list[int], chunk: int) -> None:
    """A prompt computed in chunks, then finished: its blocks stay in the prefix cache."""
    seq = seq_of(tokens, "first")
    for end in range(chunk, len(tokens) + chunk, chunk):
        compute(kv, seq, min(end, len(tokens)))
    kv.free(seq)


def test_a_hit_restores_the_snapshot_at_its_last_block_and_takes_nothing_before_it():
    bm = BlockManager(100, 4)
    kv = KVCacheManager(bm, KVGroups.for_layers([LINEAR, FULL]))
    prompt = list(range(10, 50))  # 10 blocks
    finished_prompt(kv, prompt, chunk=7)  # chunks end inside blocks: every block's state is kept
    seq = seq_of(prompt + [3, 4], "second")
    assert kv.allocate_prefix(seq) == 40
    full, linear = seq.block_tables
    assert len(full) == 10 and FREED not in full
    # The query at 40 reads the state after token 39: block 9's, left behind at its end.
    assert linear[:9] == [FREED] * 9 and linear[9] != FREED
    kv.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_without_its_snapshot_a_hit_falls_back_to_the_previous_boundary():
    bm = BlockManager(20, 4)  # the prompt's 10 blocks in each group: nothing left on the free list
    kv = KVCacheManager(bm, KVGroups.for_layers([LINEAR, FULL]))
    prompt = list(range(10, 50))
    # One step: the model writes each block's state at its end, so every boundary has one.
    finished_prompt(kv, prompt, chunk=40)
    probe = seq_of(prompt + [1], "probe")
    kv.allocate_prefix(probe)
    last_snapshot = probe.block_tables[1][9]
    kv.free(probe)
    bm._evictable.move_to_end(last_snapshot, last=False)  # evicted first
    taken = bm._allocate_fresh()
    assert taken == last_snapshot
    seq = seq_of(prompt + [1], "again")
    # The full group holds all 10 blocks; the state after token 39 is gone, the one after 35
    # (block 8's) is not.
    assert kv.allocate_prefix(seq) == 36
    assert seq.block_tables[1] == [FREED] * 8 + [seq.block_tables[1][8]]
    kv.free(seq)
    bm.free([taken])
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("n", [1, 4, 5, 8, 9, 33])
def test_a_handoff_moves_one_state_block_per_linear_group(n):
    groups = KVGroups.for_layers(HYBRID)
    prefill = KVCacheManager(BlockManager(200, 4), groups)
    seq = seq_of(list(range(n)))
    compute(prefill, seq, n)
    sent = handoff_blocks(prefill.readable_tables(seq, n), 0)
    decode = KVCacheManager(BlockManager(200, 4), groups)
    arriving = seq_of(list(range(n)))
    assert decode.allocate_arriving(arriving, n, 0)
    reserved = handoff_blocks(arriving.block_tables, 0)
    whole = -(-n // 4)
    assert prefill.handoff_size(n) == len(sent) == len(reserved) == whole + 3
    for table in arriving.block_tables[1:]:  # each linear group: the block of token n - 1
        assert [i for i, b in enumerate(table) if b != FREED] == [(n - 1) // 4]


SHAPE = LinearStateShape(
    pool_heads=2,
    head_dim=8,
    planes=2,
    num_k_heads=2,
    num_v_heads=4,
    head_k_dim=8,
    head_v_dim=6,
    conv_kernel=4,
)


def pages(shape: LinearStateShape, num_blocks: int, heads: int) -> tuple[torch.Tensor, ...]:
    block_size = shape.min_block_size()
    return tuple(torch.zeros(num_blocks, block_size, heads, shape.head_dim) for _ in range(2))


def test_a_state_written_to_pages_reads_back_and_leaves_other_blocks_alone():
    planes = pages(SHAPE, 12, 2)
    other = torch.randn_like(planes[0][3])
    planes[0][3] = other
    conv = torch.randn(3, SHAPE.conv_dim, 3)
    recurrent = torch.randn(3, 4, 8, 6)
    blocks = torch.tensor([7, 2, 5])
    SHAPE.write(planes, blocks, conv, recurrent)
    got_conv, got_recurrent = SHAPE.read(planes, blocks)
    assert torch.equal(got_conv, conv) and torch.equal(got_recurrent, recurrent)
    assert torch.equal(planes[0][3], other)
    # The page is as small as the state allows: one token less would not hold it.
    assert SHAPE.per_head <= 2 * SHAPE.min_block_size() * 8 < SHAPE.per_head + 2 * 8


def test_a_ranks_share_of_the_pages_holds_its_heads_states():
    """Cutting pages by the pool's heads cuts states by the linear heads: what a rank of two
    reads from its half of the heads is its own k and v heads' state."""
    planes = pages(SHAPE, 6, 2)
    conv = torch.randn(2, SHAPE.conv_dim, 3)
    recurrent = torch.randn(2, 4, 8, 6)
    blocks = torch.tensor([1, 4])
    SHAPE.write(planes, blocks, conv, recurrent)
    rank = LinearStateShape(1, 8, 2, 1, 2, 8, 6, 4)
    assert rank.min_block_size() == SHAPE.min_block_size()
    for r in range(2):
        got_conv, got_recurrent = rank.read(tuple(p[:, :, r : r + 1] for p in planes), blocks)
        assert torch.equal(got_recurrent, recurrent[:, 2 * r : 2 * r + 2])
        q, k, v = conv.split([16, 16, 24], dim=1)
        want = torch.cat(
            [q[:, 8 * r : 8 * r + 8], k[:, 8 * r : 8 * r + 8], v[:, 12 * r : 12 * r + 12]], 1
        )
        assert torch.equal(got_conv, want)


def hybrid_config(**linear: int) -> ModelConfig:
    fields = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4)
    return ModelConfig(
        model_type="qwen3_5_text",
        vocab_size=10,
        hidden_size=16,
        intermediate_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        qk_norm=True,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_ids=(),
        layer_kinds=("linear", "linear", "linear", "full"),
        linear_attention=LinearAttention(**{**fields, **linear}),
    )


def test_the_block_size_rises_to_a_multiple_that_holds_a_state():
    cfg = hybrid_config()
    minimum = SHAPE.min_block_size()
    assert LinearStateShape.for_model(cfg) == SHAPE
    assert fitted_block_size(cfg, 4) == 4 * -(-minimum // 4) >= minimum
    assert fitted_block_size(cfg, 256) == 256
    assert LinearStateShape.for_model(cfg, 2) == LinearStateShape(1, 8, 2, 1, 2, 8, 6, 4)
    with pytest.raises(ValueError, match="does not divide .* 3 linear value heads"):
        LinearStateShape.for_model(hybrid_config(num_v_heads=3), 2)


def test_pdserve_tune_refuses_a_hybrid_rather_than_price_its_state_as_attention():
    from pdserve.engine.models.config import UnsupportedModelError
    from pdserve.tune.model_shape import ModelShape

    with pytest.raises(UnsupportedModelError, match="linear-attention layers"):
        ModelShape.from_config(hybrid_config(), "hybrid")
