"""Verification steps and decodes carrying forced tokens as decode rows, the layout that lets them
replay CUDA graphs (`pdserve.engine.execution.decode_rows`). Off CUDA nothing is captured, so
`DecodeGraphs.run` runs the model eagerly on exactly the padded decode rows a graph would replay:
these tests check the row sizes, the flattening and the padding, and that speculation (n-gram and
draft model) and forced tokens give the eager path's tokens through them. The CUDA tests at the
end capture and replay (they skip here)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import build_draft_checkpoint

from pdserve.cluster.structured_output import StructuredOutput
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.execution.decode_graphs import capture_sizes, padded_size
from pdserve.engine.execution.decode_rows import (
    FORCED_GRAPH_TOKENS,
    ROW_STRIDE,
    as_decode_rows,
    graph_query_len,
    graph_row_sizes,
)
from pdserve.engine.execution.forward_batch import AttentionBatch

MODEL = "pdserve-stories"
K = 4
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "adaptive": False})
STORY = (
    "Once upon a time, there was a little cat named Tom. Tom liked to play in the garden. "
    "One day, Tom saw a big red ball in the garden. "
)
PROMPTS = [STORY, STORY[:60], STORY[40:], "Lily had a red ball."]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


# --- the bookkeeping alone -----------------------------------------------------------------------


@pytest.mark.parametrize("max_batch", [1, 3, 8, 17, 64, 256])
@pytest.mark.parametrize("max_query", [1, 2, 5])
def test_row_sizes_hold_every_step_with_bounded_padding(max_batch, max_query):
    sizes = graph_row_sizes(max_batch, max_query)
    assert sizes == sorted(set(sizes))
    assert sizes[: len(capture_sizes(max_batch))] == capture_sizes(max_batch)
    assert sizes[-1] == max_batch * max_query
    for rows in range(1, sizes[-1] + 1):
        size = padded_size(rows, sizes)
        # Decode batches pad as before; longer steps by less than a stride.
        assert size - rows < (8 if rows <= max_batch else ROW_STRIDE), (rows, size)
    assert padded_size(sizes[-1] + 1, sizes) is None


def test_row_sizes_stop_at_the_step_budget():
    assert graph_row_sizes(64, 5, max_rows=100) == [*capture_sizes(64), 96, 100]
    assert graph_row_sizes(64, 5, max_rows=32) == capture_sizes(64)
    assert graph_row_sizes(64, 1, max_rows=4096) == capture_sizes(64)
    with pytest.raises(ValueError, match="max_query_len"):
        graph_row_sizes(8, 0)


def test_graph_query_len_covers_drafts_and_forced_tokens():
    assert graph_query_len(0, False) == 1
    assert graph_query_len(K, False) == 1 + K
    assert graph_query_len(0, True) == 1 + FORCED_GRAPH_TOKENS
    assert graph_query_len(12, True) == 13


def chunk_batch() -> AttentionBatch:
    """A decode (1 token, context 7), a verification (1 + 3 drafts, context 12 after them) and
    forced tokens (1 + 1, context 5), with a second KV group's tables."""
    query_lens = [1, 4, 2]
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]], dtype=torch.int32)
    return AttentionBatch(
        slot_mapping=torch.arange(100, 107),
        block_tables=tables,
        seq_lens=torch.tensor([7, 12, 5]),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        max_query_len=4,
        group_slot_mappings=(torch.arange(200, 207),),
        group_block_tables=(tables + 10,),
    )


def test_each_token_becomes_a_decode_row_whose_context_ends_at_it():
    batch = chunk_batch()
    rows = as_decode_rows(batch)
    # Row by row: the sequence it belongs to, and its context (the sequence's, less the chunk's
    # tokens after it).
    seq_of_row = [0, 1, 1, 1, 1, 2, 2]
    expected_lens = [7, 9, 10, 11, 12, 4, 5]
    assert rows.seq_lens.tolist() == expected_lens
    assert rows.max_query_len == 1
    assert rows.query_start_loc.tolist() == list(range(8))
    assert torch.equal(rows.block_tables, batch.block_tables[seq_of_row])
    assert torch.equal(rows.group_block_tables[0], batch.group_block_tables[0][seq_of_row])
    assert torch.equal(rows.slot_mapping, batch.slot_mapping)
    assert torch.equal(rows.group_slot_mappings[0], batch.group_slot_mappings[0])


def test_a_decode_only_batch_is_its_own_decode_rows():
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    batch = AttentionBatch(
        torch.tensor([9, 13]), tables, torch.tensor([6, 2]), torch.tensor([0, 1, 2]), 1
    )
    rows = as_decode_rows(batch)
    assert rows.seq_lens.tolist() == [6, 2] and torch.equal(rows.block_tables, tables)


# --- through the model (off CUDA: the padded rows run eagerly) -----------------------------------


def with_row_graphs(llm: LLM, runner=None, max_batch: int = 8, max_query: int = 1 + K):  # noqa: ANN001, ANN201
    """The engine's runner (or `runner`) with the decode graphs a GPU would capture, uncaptured."""
    runner = runner or llm.engine.runner
    runner.decode_graphs = runner.build_decode_graphs(
        max_batch, llm.engine.max_model_len, max_query, llm.engine.config.max_num_batched_tokens
    )
    return runner.decode_graphs


def generate(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:  # noqa: ANN001
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return generate(LLM(MODEL, device="cpu"), GREEDY)


def test_ngram_verification_as_decode_rows_gives_plain_decodings_tokens(plain):
    llm = LLM(MODEL, device="cpu", speculative_config=NGRAM)
    graphs = with_row_graphs(llm)
    assert generate(llm, GREEDY) == plain
    stats = llm.engine.stats
    assert stats.num_accepted_tokens > 0 and graphs.row_steps > 0


def test_steps_with_chunks_longer_than_the_graphs_run_eagerly(plain):
    llm = LLM(MODEL, device="cpu", speculative_config=NGRAM)
    graphs = with_row_graphs(llm, max_query=2)  # verification steps take 1 + 4 tokens
    assert generate(llm, GREEDY) == plain
    assert llm.engine.stats.num_draft_tokens > 0 and graphs.row_steps == 0


def test_padding_rows_of_a_verification_step_write_no_kv():
    llm = LLM(MODEL, device="cpu", num_kv_blocks=64, block_size=16)
    runner = llm.engine.runner
    graphs = with_row_graphs(llm, max_batch=2, max_query=4)
    batch = chunk_batch()  # of one KV group here: blocks 1, 2 and 3
    batch.group_slot_mappings, batch.group_block_tables = (), ()
    batch.slot_mapping = torch.tensor([16, 32, 33, 34, 35, 48, 49])
    k_cache, v_cache = runner.pool.layer(0)
    k_cache[4:].fill_(float("nan"))  # a slot that a padding row would write if it wrote
    v_cache[4:].fill_(float("nan"))
    ids = torch.arange(7) + 5
    positions = batch.seq_lens[[0, 1, 1, 1, 1, 2, 2]] - 1
    out = graphs.run(ids, positions, as_decode_rows(batch))  # 7 rows padded to 8
    assert graphs.sizes == [1, 2, 8] and out.shape[0] == 7
    assert graphs.inputs.slot_mapping[7] == -1 and graphs.inputs.seq_lens[7] == 1
    assert bool(k_cache[4:].isnan().all()) and bool(v_cache[4:].isnan().all())


def test_draft_model_steps_as_decode_rows_give_plain_decodings_tokens(plain, tmp_path):
    draft = build_draft_checkpoint(resolve_model_dir(MODEL), tmp_path, num_layers=2)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(MODEL, device="cpu", speculative_config=json.dumps(config | {"adaptive": False}))
    target = with_row_graphs(llm, max_query=4)
    proposer = llm.engine.scheduler.proposer
    draft_graphs = with_row_graphs(llm, runner=proposer.runner, max_query=5)
    assert generate(llm, GREEDY) == plain
    assert target.row_steps > 0
    # The draft's catch-ups after verification ran as rows, its further drafts as decode steps.
    assert draft_graphs.row_steps > 0


def test_forced_tokens_as_decode_rows_give_the_eager_tokens():
    schema = {
        "type": "object",
        "properties": {
            "character": {"enum": ["the little cat", "the big brown dog"]},
            "happy": {"type": "boolean"},
        },
        "required": ["character", "happy"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=40, temperature=0, structured=StructuredOutput.json_schema(schema)
    )
    prompts = ["Once upon a time", "Where is the cat?"]
    runs = []
    for graphs in (False, True):
        llm = LLM(MODEL, device="cpu", num_kv_blocks=256, block_size=16, forced_tokens=True)
        row_graphs = with_row_graphs(llm, max_query=graph_query_len(0, True)) if graphs else None
        runs.append(generate(llm, params, prompts))
        assert llm.engine.stats.num_forced_tokens > 0
    assert runs[1] == runs[0]
    assert row_graphs.row_steps > 0


# --- on a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_verification_gives_plain_decodings_tokens(dtype):
    """Greedy n-gram speculation replaying captured verification graphs against plain decoding
    replaying decode graphs. float32 must match token for token; bf16 is what the gpu-check's
    `speculative` step measures (the GEMMs see more rows: cuBLAS may pick another kernel)."""
    options = dict(device="cuda", dtype=dtype, num_kv_blocks=512, block_size=16)
    options["cuda_graph_max_batch_size"] = 8  # rows up to 8 x (1 + K): few captures
    expected = generate(LLM(MODEL, **options), GREEDY)
    llm = LLM(MODEL, speculative_config=NGRAM, **options)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.graphs and graphs.sizes[-1] > graphs.max_batch_size
    replays = graphs.replays
    tokens = generate(llm, GREEDY)
    assert graphs.row_steps > 0 and graphs.replays > replays
    if dtype == "float32":
        assert tokens == expected


def test_decode_rows_score_each_chunk_as_the_chunk_forward_does():
    """Three chunks of 1, 4 and 2 tokens (from position 0: all of each context is in the step),
    through the varlen forward and as padded decode rows: the same hidden states (float32)."""
    llm = LLM(MODEL, device="cpu", num_kv_blocks=64, block_size=16)
    runner = llm.engine.runner
    graphs = with_row_graphs(llm, max_batch=2, max_query=4)
    query_lens = [1, 4, 2]
    positions = torch.tensor([p for n in query_lens for p in range(n)])
    tables = torch.tensor([[1], [2], [3]], dtype=torch.int32)
    batch = AttentionBatch(
        slot_mapping=tables[[0, 1, 1, 1, 1, 2, 2], 0].long() * 16 + positions,
        block_tables=tables,
        seq_lens=torch.tensor(query_lens),
        query_start_loc=torch.tensor([0, 1, 5, 7]),
        max_query_len=4,
    )
    ids = torch.tensor([11, 12, 13, 14, 15, 16, 17])
    with torch.inference_mode():
        chunked = runner.model(ids, positions, batch, runner.pool, runner.ops)
    rows = graphs.run(ids, positions, as_decode_rows(batch))
    torch.testing.assert_close(rows, chunked, rtol=1e-5, atol=1e-5)


def test_graphs_take_chunks_up_to_their_query_len_rows_and_width():
    llm = LLM(MODEL, device="cpu", num_kv_blocks=64, block_size=16)
    graphs = with_row_graphs(llm, max_batch=8, max_query=1 + K)
    width = graphs.inputs.max_blocks_per_seq
    assert graphs.sizes[-1] == 8 * (1 + K)
    assert graphs.fits_rows(1 + K, 8 * (1 + K), width)
    assert not graphs.fits_rows(2 + K, 8, width)  # a longer chunk: eager
    assert not graphs.fits_rows(1 + K, 8 * (1 + K) + 1, width)
    assert not graphs.fits_rows(2, 8, width + 1)
    # Plain decode steps keep the decode batch bound.
    assert graphs.fits(8, width) and not graphs.fits(9, width)
