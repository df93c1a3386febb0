"""Decode steps through the CUDA-graph path's static, padded inputs. Off CUDA nothing is captured,
so `DecodeGraphs.run` runs the model eagerly on exactly the padded rows a graph would replay: these
tests check the padding (the part a graph cannot show wrong by itself); tests/test_gpu_engine.py
checks capture and replay on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.execution.decode_graphs import (
    DecodeGraphs,
    DecodeInputs,
    capture_sizes,
    padded_size,
)
from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.llm_engine import LLMEngine

BLOCK = 4


def test_capture_sizes_cover_every_batch_with_little_padding():
    for max_batch in [1, 2, 3, 5, 8, 9, 17, 64, 100, 256]:
        sizes = capture_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
        for n in range(1, max_batch + 1):
            size = padded_size(n, sizes)
            assert size >= n and (size - n < 8), (n, size)
            assert all(s < n for s in sizes if s < size)  # the smallest that holds n
        assert padded_size(max_batch + 1, sizes) is None
    with pytest.raises(ValueError, match="max_batch_size"):
        capture_sizes(0)


def make_engine(graph_batch: int | None, **overrides: object) -> LLMEngine:
    options = dict(block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=512)
    options.update(overrides)
    engine = LLMEngine(EngineConfig(device="cpu", **options))
    if graph_batch is not None:
        runner = engine.runner
        max_blocks = -(-engine.max_model_len // BLOCK)
        runner.decode_graphs = DecodeGraphs(
            runner.model, runner.pool, runner.ops, runner.device, graph_batch, max_blocks
        )
    return engine


def run_workload(engine: LLMEngine) -> dict[str, list[int]]:
    """Seven requests arriving over the first steps, with different output lengths so the decode
    batch grows and shrinks through sizes 1..7 (padded to 1, 2, 4 and 8)."""
    prompts = random_prompts(11, [5, 31, 2, 17, 9, 44, 12])
    arrivals = [0, 0, 1, 3, 3, 6, 9]
    seqs = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i, prompt in enumerate(prompts):
            if arrivals[i] == step:
                params = SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True)
                seqs[f"r{i}"] = engine.add_request(f"r{i}", prompt, params)
        engine.step()
        step += 1
        assert step < 1000, "the step loop stopped making progress"
    return {rid: seq.output_token_ids for rid, seq in seqs.items()}


@pytest.mark.parametrize(
    "options",
    [
        {},
        # 20 blocks of 4 tokens force preemption and 8-token steps chunk the prompts.
        dict(num_kv_blocks=20, max_num_batched_tokens=8),
    ],
    ids=["roomy", "preempting"],
)
def test_padded_decode_steps_generate_the_same_tokens(options):
    expected = run_workload(make_engine(None, **options))
    engine = make_engine(8, **options)
    assert run_workload(engine) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # Batches above the largest size fall back to the eager forward, not an error.
    small = make_engine(2, **options)
    assert run_workload(small) == expected


def test_a_windowed_models_padded_decode_steps_generate_the_same_tokens(checkpoint_dir):
    # Three KV groups (one full layer, two windowed): each has its slots and tables among the
    # buffers, and the prompts outgrow the 12-token window.
    options = dict(model=str(checkpoint_dir("qwen2_sliding")))
    expected = run_workload(make_engine(None, **options))
    engine = make_engine(8, **options)
    assert len(engine.runner.decode_graphs.inputs.tables) == 3
    assert run_workload(engine) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def decode_batch(slots: list[int], tables: torch.Tensor) -> AttentionBatch:
    """One decode row per slot, one token of context each."""
    n = len(slots)
    return AttentionBatch(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.ones(n, dtype=torch.long),
        query_start_loc=torch.arange(n + 1),
        max_query_len=1,
    )


def test_padding_rows_never_write_kv_left_by_a_larger_step():
    engine = make_engine(None)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.pool, runner.ops, runner.device, 4, 16)
    hidden = engine.model.config.hidden_size
    # Four decodes into slots of blocks 1..4, then three: row 3 keeps block 4's slot as stale data.
    ids = torch.tensor([5, 6, 7, 8])
    pos = torch.tensor([0, 0, 0, 0])
    tables = torch.arange(1, 5, dtype=torch.int32).view(4, 1)
    slots = [block * BLOCK for block in range(1, 5)]

    assert graphs.run(ids, pos, decode_batch(slots, tables)).shape == (4, hidden)
    k_cache, v_cache = runner.pool.layer(0)
    k_cache[4].fill_(float("nan"))
    v_cache[4].fill_(float("nan"))
    out = graphs.run(ids[:3], pos[:3], decode_batch(slots[:3], tables[:3]))
    assert out.shape == (3, hidden) and bool(out.isfinite().all())
    assert bool(k_cache[4].isnan().all()) and bool(v_cache[4].isnan().all())
    assert graphs.inputs.slot_mapping[3] == -1 and graphs.inputs.seq_lens[3] == 1


def test_decode_inputs_refuse_what_does_not_fit():
    inputs = DecodeInputs(4, 8, torch.device("cpu"))
    ids = torch.zeros(3, dtype=torch.long)
    narrow = torch.zeros(3, 2, dtype=torch.int32)
    wide = torch.zeros(3, 9, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        inputs.load(ids, ids, decode_batch([0, 0, 0], narrow), 2)
    with pytest.raises(ValueError, match="exceed 8"):
        inputs.load(ids, ids, decode_batch([0, 0, 0], wide), 4)


def test_cpu_engine_captures_no_graphs():
    assert make_engine(None).runner.decode_graphs is None
    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="cuda")
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size"):
        EngineConfig(cuda_graph_max_batch_size=0)
