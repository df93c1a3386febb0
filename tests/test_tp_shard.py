"""What each tensor-parallel rank owns, checked alone: every head, KV head, MLP column and
vocabulary row is owned, query heads find their KV head on their own rank, a KV head is
replicated only when there are fewer than ranks; plans and the plan channel carry a step whole;
and a rank reads from the checkpoint only what it owns."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import pytest
import torch

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.embedded.tiny import TINY_CONFIG
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.loader import load_model
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.tp.plan_channel import PlanChannel, PlanTooLarge, PublisherGone
from pdserve.engine.tp.shard import TPShard, kv_head_ranges

CONFIG = ModelConfig.from_dict({**TINY_CONFIG, "vocab_size": 501})


def config(heads: int, kv_heads: int, inter: int = 96, vocab: int = 501) -> ModelConfig:
    return replace(
        CONFIG, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter, vocab_size=vocab
    )


SHAPES = [
    (h, kv, size)
    for h, kv in [(8, 8), (8, 2), (8, 1), (4, 2), (16, 4)]
    for size in (1, 2, 4, 8)
    if h % size == 0 and (kv % size == 0 or size % kv == 0)
]


@pytest.mark.parametrize("heads,kv_heads,size", SHAPES)
def test_every_query_head_finds_its_kv_head_on_its_own_rank(heads, kv_heads, size):
    group = heads // kv_heads
    owned_q: list[int] = []
    for rank in range(size):
        shard = TPShard(rank, size)
        shard.check(config(heads, kv_heads))
        q, kv = shard.q_heads(heads), shard.kv_heads(kv_heads)
        owned_q += list(q)
        # The attention kernel pairs local query head i with local KV head i // (local group).
        assert len(q) % len(kv) == 0
        local_group = len(q) // len(kv)
        for i, head in enumerate(q):
            assert head // group == kv[i // local_group]
    assert owned_q == list(range(heads))


@pytest.mark.parametrize("heads,kv_heads,size", SHAPES)
def test_kv_heads_are_split_or_replicated_evenly(heads, kv_heads, size):
    ranges = kv_head_ranges(size, kv_heads)
    counts = {h: sum(h in r for r in ranges) for h in range(kv_heads)}
    assert set(counts.values()) == {max(1, size // kv_heads)}
    if kv_heads >= size:
        assert [h for r in ranges for h in r] == list(range(kv_heads))  # each once, in order
    else:
        assert all(len(r) == 1 for r in ranges)


@pytest.mark.parametrize("vocab,size", list(itertools.product([501, 512, 7], [1, 2, 4])))
def test_vocabulary_rows_cover_the_vocabulary_once(vocab, size):
    rows = [TPShard(r, size).vocab_rows(vocab) for r in range(size)]
    assert [t for r in rows for t in r] == list(range(vocab))
    assert all(len(r) <= TPShard(0, size).vocab_rows_per_rank(vocab) for r in rows)


@pytest.mark.parametrize(
    "heads,kv_heads,inter,size,field",
    [
        (6, 2, 96, 4, "num_attention_heads"),
        (8, 8, 90, 4, "intermediate_size"),
        (8, 6, 96, 4, "num_key_value_heads"),
        (8, 2, 96, 8, None),
    ],
)
def test_a_model_the_group_cannot_split_is_refused_naming_the_field(
    heads, kv_heads, inter, size, field
):
    shard = TPShard(0, size)
    if field is None:
        shard.check(config(heads, kv_heads, inter))
        return
    with pytest.raises(ValueError, match=f"'{field}'.*tensor_parallel_size={size}|'{field}'"):
        shard.check(config(heads, kv_heads, inter))


def test_a_rank_reads_from_the_checkpoint_only_what_it_owns(checkpoint_dir, monkeypatch):
    model_dir = checkpoint_dir("qwen2")  # biases and tied embeddings
    full = load_model(model_dir, "float32", "cpu")
    read: list[int] = []
    original = CheckpointTensor.read

    def counting(self, rows=None, columns=None):  # noqa: ANN001, ANN202
        tensor = original(self, rows, columns)
        read.append(tensor.numel())
        return tensor

    monkeypatch.setattr(CheckpointTensor, "read", counting)
    parts = [load_model(model_dir, "float32", "cpu", TPShard(r, 2)) for r in range(2)]
    monkeypatch.undo()
    own = sum(p.numel() for p in parts[0].parameters()) + sum(
        p.numel() for p in parts[1].parameters()
    )
    assert sum(read) == own  # norms are replicated; everything else read once, by its owner
    # The parts put together are the whole model (q, k, v and gate, up fused by rank).
    whole = dict(full.named_parameters())
    for name in ("embed_tokens.weight", "layers.1.mlp.down_proj.weight", "norm.weight"):
        dim = 1 if "down_proj" in name else 0
        pieces = [dict(p.named_parameters())[name] for p in parts]
        joined = pieces[0] if name == "norm.weight" else torch.cat(pieces, dim=dim)
        assert torch.equal(joined, whole[name]), name


def scheduled_step() -> SchedulerOutput:
    params = SamplingParams()
    a = Sequence("a", list(range(10, 30)), params, (1,))
    a.block_table = [3, 4, 5]
    b = Sequence("b", [7, 8, 9], params, (1,))
    b.block_table = [9]
    b.num_computed_tokens = 2
    return SchedulerOutput([ScheduledSeq(a, 12), ScheduledSeq(b, 1)])


def test_a_plan_crosses_the_channel_whole_and_the_channel_says_when_rank_0_is_gone():
    plan = StepPlan.from_scheduled(scheduled_step(), block_size=8)
    assert plan.sample_rows == [1] and plan.width == 3 and plan.max_query_len == 12
    assert list(plan.slots[:3]) == [24, 25, 26]
    channel = PlanChannel(num_receivers=2, capacity=4096)
    # As a rank's process would: its own copy of the pipe's read end.
    readers = [replace(channel.inbox(i), fd=os.dup(channel.inbox(i).fd)).open() for i in range(2)]
    for _ in range(3):
        channel.publish(plan)
        for reader in readers:
            got = reader.receive()
            assert got == plan
    with pytest.raises(PlanTooLarge):
        channel.publish(bytes(8192))
    channel.close()
    with pytest.raises(PublisherGone):
        readers[0].receive()
