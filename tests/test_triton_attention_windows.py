"""The Triton attention kernels with a sliding window, a local chunk and attention sinks equal the
torch reference, checked on CPU through Triton's interpreter in a child process as
`test_triton_kernels` runs its kernels; pages no query sees, freed (-1) or filled with NaN, change
nothing; and the kernels with them compile for an H100.
"""

from __future__ import annotations

import pytest
import torch
from paged_inputs import (
    PATTERNS,
    attention_pattern,
    paged_inputs,
    unseen_blocks,
    with_unseen_blocks,
)
from test_triton_kernels import (
    ATTENTION_TOL,
    INTERPRETED,
    _compile_for_sm90,
    interpreted,
    run_interpreted,
)

from pdserve.kernels import attention_ref

pytest.importorskip("triton")

# (block size, (num_heads, num_kv_heads)): 8 and 16 do not divide the window (12); GQA 1 and 4
# (the interpreter is slow: not every pairing).
SHAPES = [(4, (2, 2)), (8, (4, 1)), (16, (4, 1))]
SHAPE_IDS = [f"b{bs}-gqa{h[0] // h[1]}" for bs, h in SHAPES]
# Contexts shorter than, equal to and just past the window and a chunk, and several windows long.
DECODE_CONTEXTS = [1, 11, 12, 13, 16, 17, 40, 95]
# Decodes beside a whole prompt several windows long, a chunk after cached context starting
# mid-window and mid-chunk, a prompt of exactly one chunk, and a chunk after a longer context.
MIXED_CONTEXTS, MIXED_QUERIES = [70, 1, 33, 50, 16, 90], [1, 1, 33, 7, 16, 20]
SMALL_TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


@pytest.mark.skipif(INTERPRETED, reason="this is the child process")
def test_kernels_match_the_reference_under_the_triton_interpreter():
    run_interpreted(__file__)


def _assert_close(actual: torch.Tensor, args: dict, local: dict) -> None:
    expected = attention_ref.paged_attention(**args, **local)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **ATTENTION_TOL[actual.dtype])


@pytest.fixture(scope="module")
def ta():
    from pdserve.kernels import triton_attention

    return triton_attention


@interpreted
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("block_size,heads", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_the_reference(ta, pattern, block_size, heads):
    queries = [1] * len(DECODE_CONTEXTS)
    args = paged_inputs(DECODE_CONTEXTS, queries, heads, 16, block_size, torch.float32, seed=1)
    local = attention_pattern(pattern, heads[0])
    _assert_close(ta.paged_attention(**args, **local), args, local)


@interpreted
@pytest.mark.parametrize(
    "local,span",
    [
        (dict(window=12), 27),
        (dict(window=100, sinks=True), 115),
        (dict(chunk=48), 63),
        (dict(sinks=True), 304),
    ],
    ids=["window", "wide-window+sinks", "chunk", "sinks"],
)
def test_split_decode_covers_the_window_alone_and_adds_the_sinks_in_the_reduce(ta, local, span):
    # 16-token splits of a table 304 tokens wide: under a window or chunk they cover only the
    # keys a query sees from the start of its first key's tile (2 splits for 12 keys, 8 for
    # 100), some of them past a short sequence's end.
    args = paged_inputs([300, 5, 64, 33, 101], [1] * 5, (4, 1), 16, 16, torch.float32, seed=2)
    local = dict(local)
    if local.pop("sinks", False):
        local["sinks"] = attention_pattern("sinks", 4)["sinks"]
    config = ta.TileConfig(**SMALL_TILES)
    cut = {k: v for k, v in local.items() if k != "sinks"}
    assert ta.decode_span(args["block_tables"].shape[1] * 16, config.block_n, **cut) == span
    out = torch.empty_like(args["query"])
    ta.paged_decode_attention(
        args["query"],
        args["k_cache"],
        args["v_cache"],
        args["block_tables"],
        args["seq_lens"],
        args["scale"],
        out,
        partition=16,
        config=config,
        **local,
    )
    _assert_close(out, args, local)


@interpreted
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("block_size,heads", SHAPES, ids=SHAPE_IDS)
def test_mixed_prefill_batch_matches_the_reference(ta, pattern, block_size, heads):
    args = paged_inputs(MIXED_CONTEXTS, MIXED_QUERIES, heads, 16, block_size, torch.float32)
    local = attention_pattern(pattern, heads[0])
    _assert_close(ta.paged_attention(**args, **local), args, local)


@interpreted
@pytest.mark.parametrize(
    "local",
    [dict(window=12), dict(window=40), dict(chunk=20), dict(window=30, chunk=16, sinks=True)],
    ids=["window-under-a-tile", "window-over-tiles", "chunk", "window+chunk+sinks"],
)
def test_prefill_tiles_mask_the_window_edge_and_the_diagonal_only(ta, local):
    # 16-row query tiles and 16-key tiles: a window narrower than a tile leaves no key every row
    # sees; a wider one leaves unmasked tiles between its edge and the diagonal.
    contexts, queries = [45, 90, 9, 33, 120], [45, 50, 0, 1, 17]
    args = paged_inputs(contexts, queries, (2, 2), 16, 16, torch.float32, seed=3)
    local = dict(local)
    if local.pop("sinks", False):
        local["sinks"] = attention_pattern("sinks", 2)["sinks"]
    out = torch.empty_like(args["query"])
    ta.paged_prefill_attention(
        args["query"],
        args["k_cache"],
        args["v_cache"],
        args["block_tables"],
        args["seq_lens"],
        args["query_start_loc"],
        args["scale"],
        out,
        config=ta.TileConfig(**SMALL_TILES),
        **local,
    )
    _assert_close(out, args, local)


@interpreted
@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("pattern", ["window", "chunk", "window+sinks"])
def test_pages_before_every_querys_first_key_are_not_read(ta, batch, pattern):
    contexts, queries = {
        "decode": (DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS)),
        "mixed": (MIXED_CONTEXTS, MIXED_QUERIES),
    }[batch]
    args = paged_inputs(contexts, queries, (4, 1), 16, 4, torch.float32, seed=4)
    local = attention_pattern(pattern, 4)
    assert sum(map(len, unseen_blocks(args, **local))) > 0
    want = ta.paged_attention(**args, **local)
    for fill in (None, float("nan")):  # freed, and pages any read of which would show
        got = ta.paged_attention(**with_unseen_blocks(args, fill, **local), **local)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@interpreted
def test_bfloat16_sinks_and_caches_match_the_reference(ta):
    args = paged_inputs(MIXED_CONTEXTS, MIXED_QUERIES, (4, 1), 16, 8, torch.bfloat16, seed=5)
    local = dict(window=12, sinks=attention_pattern("sinks", 4)["sinks"].to(torch.bfloat16))
    _assert_close(ta.paged_attention(**args, **local), args, local)
    decode = paged_inputs(DECODE_CONTEXTS, [1] * 8, (4, 1), 16, 8, torch.bfloat16, seed=6)
    _assert_close(ta.paged_attention(**decode, **local), decode, local)


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_windowed_kernels_with_sinks_compile_for_h100(monkeypatch, tmp_path):
    # The interpreter runs kernels as Python; this catches what only the compiler rejects.
    pytest.importorskip("triton.backends.nvidia")
    from pdserve.kernels import triton_attention

    launches = []

    def recorder(kernel):
        def record(*args, grid, warmup, **kwargs) -> None:
            launches.append((kernel, args, kwargs))

        return record

    for name in ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel"):
        kernel = getattr(triton_attention, name)
        monkeypatch.setattr(kernel, "run", recorder(kernel))
    dtype, heads = torch.bfloat16, (64, 8)  # gpt-oss-120b's heads
    sinks = torch.zeros(64, dtype=dtype)
    decode = paged_inputs([4000, 70], [1, 1], heads, 64, 16, dtype)
    prefill = paged_inputs([2048, 90], [2048, 30], heads, 64, 16, dtype)
    for args in (decode, prefill):
        triton_attention.paged_attention(**args, window=128, sinks=sinks)
    triton_attention.paged_attention(**prefill, chunk=8192)
    # A window's split decode and its reduce, and the prefill kernel with a window and sinks and
    # with a chunk alone.
    assert len(launches) == 4
    for kernel, args, kwargs in launches:
        _compile_for_sm90(kernel, args, kwargs, tmp_path)
