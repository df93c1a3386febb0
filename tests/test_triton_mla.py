"""The Triton kernels of multi-head latent attention (DeepSeek's MLA) equal `mla_ref`, checked on
CPU through Triton's interpreter in a child process as `test_triton_kernels` runs its kernels;
on CUDA, the decode kernel at DeepSeek-V3's width, eager and replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from paged_inputs import paged_inputs
from test_triton_kernels import (
    ATTENTION_TOL,
    INTERPRETED,
    _compile_for_sm90,
    interpreted,
    run_interpreted,
)

from pdserve.engine.execution.decode_graphs import DecodeInputs
from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.kernels import mla_ref

pytestmark = pytest.mark.slow

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16]
# (L, R) = (kv_lora_rank, qk_rope_head_dim): powers of two, and widths masked in both parts.
WIDTHS = [(32, 16), (24, 8)]
# Every head count x width in float32, block sizes alternating; in bfloat16 every head count
# once, the widths and block sizes spread over them (the interpreter is slow). 16 heads fill a
# whole head block of the decode kernel.
SHAPES = [
    (torch.float32, heads, width, block_size)
    for heads, block_size in ((1, 4), (4, 16), (16, 4))
    for width in WIDTHS
]
SHAPES += [
    (torch.bfloat16, 1, WIDTHS[1], 16),
    (torch.bfloat16, 4, WIDTHS[0], 4),
    (torch.bfloat16, 16, WIDTHS[1], 16),
]
SHAPE_IDS = [f"{str(d)[6:]}-h{h}-l{w[0]}r{w[1]}-b{bs}" for d, h, w, bs in SHAPES]
# Decode tables as wide as this many tokens (as decode graphs' are, for max_model_len), so the
# planned split divides the context: the longest context spans two splits.
DECODE_WIDTH = 160
DECODE_CONTEXTS = [150, 5, 33]


def latent_inputs(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    width: tuple[int, int],
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    table_tokens: int = 0,
    device: str = "cpu",
) -> dict:
    """`latent_attention` arguments: latents on shuffled pages, block tables padded with 0 to at
    least table_tokens, queries [q_lat, q_pe] for each sequence's last tokens."""
    lora, rope = width
    args = paged_inputs(
        context_lens, query_lens, (num_heads, 1), lora + rope, block_size, dtype, seed, device
    )
    tables = args["block_tables"]
    extra = -(-table_tokens // block_size) - tables.shape[1]
    if extra > 0:
        tables = torch.cat([tables, tables.new_zeros(tables.shape[0], extra)], dim=1)
    return dict(
        query=args["query"],
        cache=args["k_cache"],
        block_tables=tables,
        seq_lens=args["seq_lens"],
        query_start_loc=args["query_start_loc"],
        scale=(lora + rope) ** -0.5,
        max_query_len=args["max_query_len"],
        value_dim=lora,
    )


def _assert_latent_close(actual: torch.Tensor, args: dict) -> None:
    expected = mla_ref.latent_attention(**args)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **ATTENTION_TOL[actual.dtype])


@pytest.fixture(scope="module")
def tk():
    from types import SimpleNamespace

    from pdserve.kernels import triton_attention, triton_mla
    from pdserve.kernels.triton_ops import TRITON

    return SimpleNamespace(
        ops=TRITON,
        mla=triton_mla,
        plan=triton_attention.plan_decode_splits,
        sm_count=triton_attention.DEFAULT_SM_COUNT,
    )


@pytest.mark.skipif(INTERPRETED, reason="this is the child process")
def test_mla_kernels_match_references_under_the_triton_interpreter():
    run_interpreted(__file__)  # every @interpreted test below


# --- store_latent -------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_latent_writes_slots_and_skips_padding(tk, dtype, block_size):
    gen = torch.Generator().manual_seed(1)
    lora, rope = WIDTHS[1]
    # The latent as a strided view of a wider projection output, as a model slices it (in the
    # cache dtype: the interpreter truncates float32 to bfloat16 where torch rounds).
    projected = torch.randn(5, 40 + lora + rope, generator=gen).to(dtype)
    latent = projected[:, 40:].unsqueeze(1)
    slots = torch.tensor([3, 17, -1, 40, 31])
    caches = [torch.zeros(64 // block_size, block_size, 1, lora + rope, dtype=dtype) for _ in "ab"]
    mla_ref.store_latent(latent, caches[0], slots)
    tk.ops.store_latent(latent, caches[1], slots)
    assert torch.equal(caches[1], caches[0])
    assert caches[1].count_nonzero() == 4 * (lora + rope)


# --- decode -------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype,heads,width,block_size", SHAPES, ids=SHAPE_IDS)
def test_split_decode_matches_reference(tk, dtype, heads, width, block_size):
    args = latent_inputs(
        DECODE_CONTEXTS, [1, 1, 1], heads, width, block_size, dtype, table_tokens=DECODE_WIDTH
    )
    block_n = tk.mla.latent_decode_config(width[0], dtype).block_n
    num_splits, _ = tk.plan(3, 1, DECODE_WIDTH, block_n, tk.sm_count)
    assert num_splits > 1
    _assert_latent_close(tk.ops.latent_attention(**args), args)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_with_many_splits_and_empty_ones(tk, dtype):
    # 16-token splits: the 150-token context uses 10 (two steps of the reduce), the 5-token one
    # 1, the rest of each row's splits are empty.
    args = latent_inputs([150, 5, 64, 33, 1], [1] * 5, 4, WIDTHS[0], 16, dtype, seed=2)
    out = torch.empty(5, 4, WIDTHS[0][0], dtype=dtype)
    config = tk.mla.LatentTileConfig(block_h=16, block_m=16, block_n=16, num_warps=4, num_stages=1)
    tk.mla.latent_decode_attention(
        args["query"],
        args["cache"],
        args["block_tables"],
        args["seq_lens"],
        args["scale"],
        out,
        partition=16,
        config=config,
    )
    _assert_latent_close(out, args)


@interpreted
def test_short_decode_batch_takes_the_single_split_path(tk):
    args = latent_inputs([7, 16, 33], [1, 1, 1], 4, WIDTHS[1], 16, torch.float32, seed=3)
    block_n = tk.mla.latent_decode_config(WIDTHS[1][0], torch.float32).block_n
    assert tk.plan(3, 1, 48, block_n, tk.sm_count)[0] == 1
    _assert_latent_close(tk.ops.latent_attention(**args), args)


@interpreted
def test_more_heads_than_a_head_block_decode_and_prefill(tk):
    # 40 heads: three head blocks of 16, the last one half masked.
    decode = latent_inputs([40, 9], [1, 1], 40, WIDTHS[1], 4, torch.float32, seed=4)
    _assert_latent_close(tk.ops.latent_attention(**decode), decode)
    mixed = latent_inputs([20, 9], [20, 1], 40, WIDTHS[1], 4, torch.float32, seed=5)
    _assert_latent_close(tk.ops.latent_attention(**mixed), mixed)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_decode_rows_as_decode_graphs_pad_them(tk, dtype):
    # A step of 4 sequences, then one of 3 padded to 4 rows in the same static buffers: the 4th
    # row keeps the 4-sequence step's block table, gets slot -1 and one token of context.
    lora, rope = WIDTHS[0]
    block_size, heads = 4, 4
    first = latent_inputs([30, 7, 19, 41], [1] * 4, heads, WIDTHS[0], block_size, dtype, seed=6)
    second = latent_inputs([9, 40, 20], [1] * 3, heads, WIDTHS[0], block_size, dtype, seed=7)
    cache = first["cache"]
    inputs = DecodeInputs(4, DECODE_WIDTH // block_size, torch.device("cpu"))
    gen = torch.Generator().manual_seed(8)
    for args in (first, second):
        n = args["seq_lens"].shape[0]
        # Each sequence's newest token goes to its last context slot, then is attended to.
        last = args["seq_lens"] - 1
        pages = args["block_tables"].gather(1, (last // block_size)[:, None])[:, 0]
        batch = AttentionBatch(
            slot_mapping=pages.long() * block_size + last % block_size,
            block_tables=args["block_tables"],
            seq_lens=args["seq_lens"],
            query_start_loc=args["query_start_loc"],
            max_query_len=1,
        )
        inputs.load(torch.zeros(n, dtype=torch.long), last, batch, 4)
        _, _, padded = inputs.view(4)
        query = torch.zeros(4, heads, lora + rope, dtype=dtype)
        query[:n] = args["query"]
        latent = torch.randn(4, 1, lora + rope, generator=gen).to(dtype)
        expected_cache = cache.clone()
        mla_ref.store_latent(latent, expected_cache, padded.slot_mapping)
        tk.ops.store_latent(latent, cache, padded.slot_mapping)
        assert torch.equal(cache, expected_cache)
        step = dict(
            query=query,
            cache=cache,
            block_tables=padded.block_tables,
            seq_lens=padded.seq_lens,
            query_start_loc=padded.query_start_loc,
            scale=args["scale"],
            max_query_len=1,
            value_dim=lora,
        )
        _assert_latent_close(tk.ops.latent_attention(**step), step)
    assert padded.slot_mapping[3] == -1 and padded.seq_lens[3] == 1


# --- prefill / extend ---------------------------------------------------------------------------

# A fresh prompt ending mid-block, a chunk after a prefix-cache hit that ends mid-block, a decode
# riding along in the mixed batch, and a chunk after a block-aligned prior context.
MIXED_CONTEXTS = [37, 61, 50, 48]
MIXED_QUERIES = [37, 21, 1, 16]


@interpreted
@pytest.mark.parametrize("dtype,heads,width,block_size", SHAPES, ids=SHAPE_IDS)
def test_mixed_prefill_batch_matches_reference(tk, dtype, heads, width, block_size):
    args = latent_inputs(MIXED_CONTEXTS, MIXED_QUERIES, heads, width, block_size, dtype)
    _assert_latent_close(tk.ops.latent_attention(**args), args)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_with_small_tiles_spanning_many_pages(tk, dtype):
    # 16-row tiles of 4 queries x 4 heads: chunks span several query tiles (found by the kernel's
    # binary search) and key tiles (unmasked below the diagonal, masked on it); one sequence
    # schedules no tokens.
    contexts, queries = [45, 50, 9, 33, 40], [45, 18, 0, 1, 17]
    args = latent_inputs(contexts, queries, 4, WIDTHS[1], 4, dtype, seed=9)
    out = torch.empty(sum(queries), 4, WIDTHS[1][0], dtype=dtype)
    config = tk.mla.LatentTileConfig(block_h=16, block_m=16, block_n=16, num_warps=4, num_stages=1)
    tk.mla.latent_prefill_attention(
        args["query"],
        args["cache"],
        args["block_tables"],
        args["seq_lens"],
        args["query_start_loc"],
        args["scale"],
        out,
        config=config,
    )
    _assert_latent_close(out, args)


# --- the absorbed form equals the per-head form -------------------------------------------------


@interpreted
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [20, 1, 7]], ids=["decode", "mixed"])
def test_absorbed_kernel_equals_decompressed_attention(tk, query_lens):
    # Per-head keys [W_UK c_kv, k_pe] and values W_UV c_kv against the kernel's MQA over the
    # latent, with the query absorbed into latent space and the output expanded from it.
    heads, (lora, rope), nope, value = 4, WIDTHS[0], 24, 20
    gen = torch.Generator().manual_seed(10)
    args = latent_inputs([40, 9, 23], query_lens, heads, (lora, rope), 4, torch.float32, seed=11)
    tokens = sum(query_lens)
    q_nope = torch.randn(tokens, heads, nope, generator=gen)
    q_pe = torch.randn(tokens, heads, rope, generator=gen)
    w_uk = torch.randn(heads, nope, lora, generator=gen) / lora**0.5
    w_uv = torch.randn(heads, value, lora, generator=gen) / lora**0.5
    scale = (nope + rope) ** -0.5
    args.update(query=torch.cat([mla_ref.absorb_query(q_nope, w_uk), q_pe], dim=-1), scale=scale)
    got = mla_ref.expand_output(tk.ops.latent_attention(**args), w_uv)
    expected = mla_ref.decompressed_attention(
        q_nope,
        q_pe,
        args["cache"],
        w_uk,
        w_uv,
        args["block_tables"],
        args["seq_lens"],
        args["query_start_loc"],
        scale,
    )
    # The two forms multiply in different orders: float32 rounding, values of magnitude ~1.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --- compiling for a GPU without one -----------------------------------------------------------


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_mla_kernels_compile_for_h100_at_deepseek_v3_shapes(monkeypatch, tmp_path):
    # DeepSeek-V3's latent (L = 512, R = 64) in bf16, 16 heads a rank (tensor parallel 8) and
    # all 128: each launch compiles for sm_90 without register spills.
    from pdserve.kernels import triton_mla
    from pdserve.kernels.triton_ops import TRITON

    pytest.importorskip("triton.backends.nvidia")
    launches = []

    def recorder(kernel):
        def record(*args, grid, warmup, **kwargs) -> None:
            launches.append((kernel, args, kwargs))

        return record

    for name in dir(triton_mla):
        if name.endswith("_kernel"):
            kernel = getattr(triton_mla, name)
            monkeypatch.setattr(kernel, "run", recorder(kernel))
    for heads in (16, 128):
        decode = latent_inputs([4000, 70], [1, 1], heads, (512, 64), 16, torch.bfloat16)
        short = latent_inputs([40, 70], [1, 1], heads, (512, 64), 16, torch.bfloat16)
        prefill = latent_inputs([2048, 90], [2048, 30], heads, (512, 64), 16, torch.bfloat16)
        for args in (decode, short, prefill):
            TRITON.latent_attention(**args)
    latent = torch.zeros(4, 1, 576, dtype=torch.bfloat16)
    TRITON.store_latent(latent, decode["cache"], torch.arange(4))
    # Per head count: split decode + its reduce, single-split decode, prefill; then the store.
    assert len(launches) == 9
    for kernel, args, kwargs in launches:
        # `_compile_for_sm90` picks the GPU's dot precision from the operand it finds as
        # k_cache_ptr: the latent cache plays that part here.
        operand = {"k_cache_ptr": args[1]} if "UPCAST_DOT" in kwargs else {}
        _compile_for_sm90(kernel, args, {**kwargs, **operand}, tmp_path)


# --- on CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_at_deepseek_v3_width_on_cuda_eager_and_replayed_from_a_graph():
    from pdserve.kernels.triton_ops import TRITON

    lora, rope, heads, dtype = 512, 64, 16, torch.bfloat16
    # GPU exp2 is approximate and contexts run to thousands of keys (test_gpu_engine's bound).
    tol = dict(atol=2e-2, rtol=2e-2)
    width = 4096  # tokens each block-table row can hold, as max_model_len fixes it
    args = latent_inputs(
        [4000, 70, 1, 513],
        [1] * 4,
        heads,
        (lora, rope),
        16,
        dtype,
        table_tokens=width,
        device="cuda",
    )
    torch.testing.assert_close(
        TRITON.latent_attention(**args), mla_ref.latent_attention(**args), **tol
    )

    # Static buffers as decode graphs keep them; a new token's latent is stored, then attended.
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    slots = torch.full((4,), -1, dtype=torch.long, device="cuda")
    latent = torch.zeros(4, 1, lora + rope, dtype=dtype, device="cuda")

    def step() -> torch.Tensor:
        TRITON.store_latent(latent, static["cache"], slots)
        return TRITON.latent_attention(**static)

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    # Other contexts (so other split counts per row) in the same buffers: the rows swap pages,
    # and row 3 becomes padding (one token of context, slot -1).
    static["block_tables"].copy_(args["block_tables"][[1, 0, 3, 2]])
    static["seq_lens"].copy_(torch.tensor([77, 3999, 500, 1]))
    static["query"].copy_(torch.randn(4, heads, lora + rope).to(dtype))
    last = static["seq_lens"] - 1
    pages = static["block_tables"].gather(1, (last // 16)[:, None])[:, 0]
    slots.copy_(pages.long() * 16 + last % 16)
    slots[3] = -1
    latent.copy_(torch.randn(4, 1, lora + rope).to(dtype))
    expected_cache = static["cache"].clone()
    mla_ref.store_latent(latent, expected_cache, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static["cache"], expected_cache)
    torch.testing.assert_close(out, mla_ref.latent_attention(**static), **tol)
