"""Every Triton kernel equals its torch reference, checked on CPU through Triton's interpreter.

Triton chooses interpreter or compiler once, when it is imported, so the kernel checks run in a
child pytest process started with TRITON_INTERPRET=1; this process (and every other test module)
keeps the compiled kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from paged_inputs import paged_inputs

from pdserve.kernels import attention_ref, moe_ref, norm_ref, rotary_ref
from pdserve.kernels.moe_align import align_pairs_to_blocks, max_padded_rows

pytestmark = pytest.mark.slow

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parent.parent
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Attention against the reference run in the same dtype, on outputs of magnitude up to ~3.
# float32 differs only in summation order (worst seen: 1.3e-6). In half precision both sides
# round, the kernel also its softmax weights before P @ V (as flash attention does); worst seen:
# bfloat16 1.6e-2 (two units in the last place near 2), float16 2e-3.
ATTENTION_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
# Norms and rotary round where the reference rounds, so on a GPU they match it to the last bit up
# to summation order. Triton's interpreter, though, converts float32 to bfloat16 by truncation
# (GPUs round to nearest even), so here bfloat16 may be two units in the last place off (values
# up to ~4); float16 conversions are exact in the interpreter and rotary is compared bit for bit.
ROUNDING_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_heads, num_kv_heads): GQA ratios 1, 4 and 8.
HEADS = [(2, 2), (4, 1), (8, 1)]
# Attention shapes: every GQA ratio x (head dim, block size) pairing in float32; in each half
# precision dtype every ratio once, the pairings spread over them (the interpreter is slow).
SHAPES = [(torch.float32, h, 64, 16) for h in HEADS] + [(torch.float32, h, 128, 32) for h in HEADS]
SHAPES += [
    (torch.bfloat16, HEADS[0], 64, 16),
    (torch.bfloat16, HEADS[1], 128, 32),
    (torch.bfloat16, HEADS[2], 64, 32),
    (torch.float16, HEADS[0], 128, 32),
    (torch.float16, HEADS[1], 64, 16),
    (torch.float16, HEADS[2], 128, 16),
]


SHAPE_IDS = [f"{str(d)[6:]}-gqa{h[0] // h[1]}-d{hd}-b{bs}" for d, h, hd, bs in SHAPES]


def interpreted(test):
    """A kernel check: collected only in the child process that runs under the interpreter."""
    return test if INTERPRETED else None


@pytest.fixture(scope="module")
def tk() -> SimpleNamespace:
    from pdserve.kernels import triton_attention, triton_moe
    from pdserve.kernels.triton_ops import TRITON

    return SimpleNamespace(ops=TRITON, attention=triton_attention, moe=triton_moe)


def run_interpreted(test_file: str) -> None:
    """Run a test file's @interpreted tests in a child process under Triton's interpreter; a
    failure shows the child's report."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.skipif(INTERPRETED, reason="this is the child process")
def test_kernels_match_references_under_the_triton_interpreter():
    run_interpreted(__file__)


# --- inputs -------------------------------------------------------------------------------------


def _assert_attention_close(actual: torch.Tensor, args: dict) -> None:
    expected = attention_ref.paged_attention(**args)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **ATTENTION_TOL[actual.dtype])


# --- decode -------------------------------------------------------------------------------------

# Contexts end mid-block for block sizes 16 and 32, and the longest spans several splits.
DECODE_CONTEXTS = [300, 17, 129]


@interpreted
@pytest.mark.parametrize("dtype,heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_split_decode_matches_reference(tk, dtype, heads, head_dim, block_size):
    args = paged_inputs(DECODE_CONTEXTS, [1, 1, 1], heads, head_dim, block_size, dtype)
    max_context = args["block_tables"].shape[1] * block_size
    block_n = tk.attention.decode_config(head_dim, dtype).block_n
    num_splits, _ = tk.attention.plan_decode_splits(
        3, heads[1], max_context, block_n, tk.attention.DEFAULT_SM_COUNT
    )
    assert num_splits > 1
    _assert_attention_close(tk.ops.paged_attention(**args), args)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_with_many_splits_and_empty_ones(tk, dtype):
    # 32-token splits: the 300-token context uses 10, the 5-token one 1, the rest are empty.
    args = paged_inputs([300, 5, 64, 33], [1] * 4, (4, 1), 64, 16, dtype, seed=1)
    out = torch.empty_like(args["query"])
    tk.attention.paged_decode_attention(
        args["query"],
        args["k_cache"],
        args["v_cache"],
        args["block_tables"],
        args["seq_lens"],
        args["scale"],
        out,
        partition=32,
        config=tk.attention.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
    )
    _assert_attention_close(out, args)


@interpreted
def test_short_decode_batch_takes_the_single_split_path(tk):
    args = paged_inputs([7, 16, 33], [1, 1, 1], (4, 1), 64, 16, torch.float32, seed=2)
    block_n = tk.attention.decode_config(64, torch.float32).block_n
    plan = tk.attention.plan_decode_splits(3, 1, 48, block_n, tk.attention.DEFAULT_SM_COUNT)
    assert plan[0] == 1
    _assert_attention_close(tk.ops.paged_attention(**args), args)


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_decode_split_plan_fills_the_device_and_covers_the_context():
    from pdserve.kernels.triton_attention import plan_decode_splits

    # Llama-3-8B shapes on an H100: batch 1 at 4k context is split, batch 256 is not.
    splits, partition = plan_decode_splits(1, 8, 4096, 64, 132)
    assert splits > 8 and partition % 64 == 0 and splits * partition >= 4096
    assert plan_decode_splits(256, 8, 4096, 64, 132)[0] == 1
    for context in (1, 17, 128, 129, 4097):
        splits, partition = plan_decode_splits(2, 2, context, 32, 132)
        assert (splits - 1) * partition < context <= splits * partition


# --- prefill / extend ---------------------------------------------------------------------------

# A fresh prompt ending mid-block, a chunk after a prefix-cache hit that ends mid-block, a decode
# riding along in the mixed batch, and a chunk after a block-aligned prior context.
MIXED_CONTEXTS = [37, 61, 50, 48]
MIXED_QUERIES = [37, 21, 1, 16]


@interpreted
@pytest.mark.parametrize("dtype,heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_mixed_prefill_batch_matches_reference(tk, dtype, heads, head_dim, block_size):
    args = paged_inputs(MIXED_CONTEXTS, MIXED_QUERIES, heads, head_dim, block_size, dtype)
    _assert_attention_close(tk.ops.paged_attention(**args), args)


@interpreted
@pytest.mark.parametrize(
    "dtype,heads",
    [
        (torch.float32, (2, 2)),
        (torch.float32, (8, 2)),
        (torch.bfloat16, (8, 2)),
        (torch.float16, (2, 2)),
    ],
    ids=["float32-gqa1", "float32-gqa4", "bfloat16-gqa4", "float16-gqa1"],
)
def test_prefill_with_small_tiles_spanning_many_pages(tk, dtype, heads):
    # 16-row tiles: chunks span several query tiles (found by the kernel's binary search) and key
    # tiles (unmasked below the diagonal, masked on it); one sequence schedules no tokens.
    contexts, queries = [45, 50, 9, 33, 40], [45, 18, 0, 1, 17]
    args = paged_inputs(contexts, queries, heads, 64, 16, dtype, seed=3)
    out = torch.empty_like(args["query"])
    tk.attention.paged_prefill_attention(
        args["query"],
        args["k_cache"],
        args["v_cache"],
        args["block_tables"],
        args["seq_lens"],
        args["query_start_loc"],
        args["scale"],
        out,
        config=tk.attention.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
    )
    _assert_attention_close(out, args)


@interpreted
@pytest.mark.parametrize("head_dim", [8, 96])
def test_attention_reads_strided_queries_and_odd_head_dims(tk, head_dim):
    # The engine passes q as a view of the fused qkv; head dims pad up to a power of two >= 16.
    args = paged_inputs([20, 9], [20, 9], (4, 2), head_dim, 16, torch.float32, seed=4)
    qkv = torch.randn(29, 8, head_dim)
    qkv[:, :4] = args["query"]
    args["query"] = qkv[:, :4]
    _assert_attention_close(tk.ops.paged_attention(**args), args)
    decode = paged_inputs([20, 9], [1, 1], (4, 2), head_dim, 16, torch.float32, seed=5)
    _assert_attention_close(tk.ops.paged_attention(**decode), decode)


# --- store_kv -----------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_slots_and_skips_padding(tk, dtype):
    gen = torch.Generator().manual_seed(6)
    num_kv_heads, head_dim = 2, 64
    qkv = torch.randn(5, 8, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views, as the engine passes them
    slots = torch.tensor([3, 17, -1, 40, 31])
    caches = [torch.zeros(4, 16, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    attention_ref.store_kv(key, value, caches[0], caches[1], slots)
    tk.ops.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


# --- norms --------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference_on_rows_and_head_views(tk, dtype):
    gen = torch.Generator().manual_seed(7)
    x = (2 * torch.randn(5, 96, generator=gen)).to(dtype)
    weight = torch.rand(96, generator=gen).add(0.5).to(dtype)
    torch.testing.assert_close(
        tk.ops.rms_norm(x, weight, 1e-6), norm_ref.rms_norm(x, weight, 1e-6), **ROUNDING_TOL[dtype]
    )
    # q/k norm: over head_dim of a [T, H, D] view of the fused qkv.
    qkv = torch.randn(5, 6, 32, generator=gen).to(dtype)
    q, head_weight = qkv[:, :4], weight[:32]
    got = tk.ops.rms_norm(q, head_weight, 1e-6)
    torch.testing.assert_close(got, norm_ref.rms_norm(q, head_weight, 1e-6), **ROUNDING_TOL[dtype])


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_returns_norm_and_sum_leaving_inputs(tk, dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    residual = torch.randn(7, 64, generator=gen).to(dtype)
    weight = torch.rand(64, generator=gen).add(0.5).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    normed, summed = tk.ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(summed, ref_summed, **ROUNDING_TOL[dtype])
    else:
        assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **ROUNDING_TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(residual, r0)


# --- rotary -------------------------------------------------------------------------------------


def _cos_sin(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_rotary_rotates_qkv_views_in_place(tk, dtype, head_dim):
    gen = torch.Generator().manual_seed(9)
    num_heads, num_kv_heads = 4, 1
    qkv = torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 99])
    cos_sin = _cos_sin(128, head_dim)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    expected_q, expected_k = rotary_ref.apply_rotary(q.clone(), k.clone(), positions, cos_sin)
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    got_q, got_k = tk.ops.apply_rotary(q, k, positions, cos_sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    if dtype == torch.float16:
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    else:
        torch.testing.assert_close(q, expected_q, **ROUNDING_TOL[dtype])
        torch.testing.assert_close(k, expected_k, **ROUNDING_TOL[dtype])
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)


# --- mixture of experts -------------------------------------------------------------------------

# The fused MoE against the reference in the same dtype, on outputs of magnitude up to ~4 (worst
# seen below over these inputs and 32 more routings). float32 differs only in summation order
# (1.2e-6). In half precision both round at the same five points (gate, up, silu, their product,
# the expert's output): float16 agrees to a unit in the last place (4.9e-4); the interpreter
# truncates to bfloat16 where the reference rounds to nearest, so bfloat16 drifts by a few units
# (7.8e-2, five units near 4; a torch model of the reference that truncates at those five points
# matches the kernel bit for bit).
MOE_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
# 8 experts, 2 per token; hidden 48 and intermediate 40 are not multiples of any tile size.
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTER = 8, 2, 48, 40
# Routes over experts {0, 3, 4, 7} only, each in either slot: at 40 tokens experts 0 and 4 get
# exactly one 16-row block of pairs, 3 and 7 a block and a half, the rest nothing.
MOE_ROUTES = [(3, 0), (7, 4), (0, 3), (4, 7), (3, 7)]


def _moe_inputs(num_tokens: int, dtype: torch.dtype, seed: int, routed: bool) -> dict:
    """Fused MoE arguments: the routes above, or (routed) a softmax router's top-k over all."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, MOE_HIDDEN, generator=gen)
    w13 = torch.randn(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, generator=gen) / MOE_HIDDEN**0.5
    w2 = torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, generator=gen) / MOE_INTER**0.5
    if routed:
        probs = torch.softmax(torch.randn(num_tokens, MOE_EXPERTS, generator=gen), dim=-1)
        weights, ids = torch.topk(probs, MOE_TOP_K, dim=-1)
    else:
        ids = torch.tensor([MOE_ROUTES[t % len(MOE_ROUTES)] for t in range(num_tokens)])
        weights = torch.rand(num_tokens, MOE_TOP_K, generator=gen).add(0.1)
        ids = ids.reshape(num_tokens, MOE_TOP_K)  # [0, k] too when there are no tokens
    return dict(
        hidden=hidden.to(dtype),
        w13=w13.to(dtype),
        w2=w2.to(dtype),
        topk_weights=weights / weights.sum(dim=-1, keepdim=True),
        topk_ids=ids,
    )


def _assert_moe_close(actual: torch.Tensor, args: dict) -> None:
    expected = moe_ref.fused_moe(**args)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **MOE_TOL[actual.dtype])


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fused_moe_matches_reference_when_experts_are_skipped_or_shared(tk, dtype, num_tokens):
    args = _moe_inputs(num_tokens, dtype, seed=10, routed=False)
    _assert_moe_close(tk.moe.fused_moe(**args), args)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_moe_matches_reference_on_router_choices(tk, dtype):
    args = _moe_inputs(33, dtype, seed=11, routed=True)
    _assert_moe_close(tk.moe.fused_moe(**args), args)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_with_small_tiles_steps_over_columns_and_reduction(tk, dtype):
    # 16-wide tiles: three column blocks and three reduction steps per GEMM, the last masked.
    args = _moe_inputs(40, dtype, seed=12, routed=True)
    config = tk.moe.MoeTileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    _assert_moe_close(tk.moe.fused_moe(**args, config=config), args)


@interpreted
def test_fused_moe_of_no_tokens_is_empty(tk):
    args = _moe_inputs(0, torch.bfloat16, seed=13, routed=True)
    out = tk.moe.fused_moe(**args)
    assert out.shape == (0, MOE_HIDDEN) and out.dtype == torch.bfloat16


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("num_tokens", [0, 1, 40])
def test_expert_blocks_hold_each_pair_once_and_one_expert_each(num_tokens, block_m):
    gen = torch.Generator().manual_seed(14)
    topk_ids = torch.randint(0, MOE_EXPERTS, (num_tokens, 3), generator=gen)
    topk_ids[topk_ids == 5] = 2  # expert 5 receives nothing
    blocks = align_pairs_to_blocks(topk_ids, MOE_EXPERTS, block_m)
    flat, sentinel = topk_ids.reshape(-1), blocks.num_pairs
    assert sentinel == flat.numel()
    # Sized by shapes alone, so a CUDA graph replays it for any routes.
    max_padded = max_padded_rows(flat.numel(), MOE_EXPERTS, block_m)
    assert blocks.sorted_pair_ids.shape == (max_padded,)
    assert blocks.block_expert.shape == (max_padded // block_m,)
    ids = blocks.sorted_pair_ids.tolist()
    assert sorted(i for i in ids if i != sentinel) == list(range(flat.numel()))
    counts = torch.bincount(flat, minlength=MOE_EXPERTS).tolist()
    used = sum(-(-c // block_m) for c in counts)
    assert blocks.num_padded.tolist() == [used * block_m]
    assert int(blocks.num_used_blocks) == used
    for b, expert in enumerate(blocks.block_expert.tolist()):
        rows = ids[b * block_m : (b + 1) * block_m]
        pairs = [i for i in rows if i != sentinel]
        if b >= used:
            assert expert == -1 and not pairs
            continue
        # The block's pairs first, in their original order, then the sentinel.
        assert pairs and rows == pairs + [sentinel] * (block_m - len(pairs))
        assert pairs == sorted(pairs) and all(flat[p] == expert for p in pairs)
    assert blocks.block_expert[:used].diff().ge(0).all()  # experts in order


# --- the op table in the engine -----------------------------------------------------------------


@interpreted
def test_engine_with_triton_ops_generates_what_the_reference_does(tk, monkeypatch):
    # The whole model through the Triton op table (interpreted): chunked prefill, a prefix-cache
    # hit between the two prompts, decode steps and the engine's strided qkv views.
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.tp import model_shard

    prompts = [list(range(5, 40)), list(range(5, 21)) + [7, 8, 9]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    options = dict(num_kv_blocks=32, max_num_batched_tokens=24, block_size=16)
    expected = [o.token_ids for o in LLM(None, **options).generate(prompts, params)]
    monkeypatch.setattr(model_shard, "select_ops", lambda device, backend: tk.ops)
    llm = LLM(None, **options)
    assert llm.engine.ops.name == "triton"
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


@interpreted
def test_padded_decode_inputs_through_triton_ops_generate_what_the_reference_does(tk):
    # What a CUDA graph replays, run eagerly: the decode kernel over block tables as wide as
    # max_model_len, 4 sequences, then 3 padded to 4 rows (the 4th row left by the larger step
    # becomes slot -1 with one token of context), then 2 and 1.
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.execution.decode_graphs import DecodeGraphs

    prompts = [list(range(5, 30)), list(range(40, 47)), list(range(9, 27)), list(range(60, 81))]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 3, 4, 2)]
    options = dict(num_kv_blocks=16, block_size=16)
    expected = [o.token_ids for o in LLM(None, **options).generate(prompts, params)]
    llm = LLM(None, **options)
    runner = llm.engine.runner
    runner.ops = tk.ops
    runner.decode_graphs = DecodeGraphs(
        runner.model, runner.pool, tk.ops, runner.device, 4, -(-llm.engine.max_model_len // 16)
    )
    assert runner.decode_graphs.inputs.block_tables.shape == (4, 16)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


# --- compiling for a GPU without one -----------------------------------------------------------

TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TRITON_TYPES.update({torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"})


def _compile_for_sm90(  # noqa: ANN201
    kernel, args: tuple, kwargs: dict, scratch: Path, capability: int = 90
):
    """Compile one recorded launch for an H100 (or another `capability`) as Triton's launcher
    would specialize it (16-byte aligned pointers, ints divisible by 16 marked so) and fail on any
    compile error or spill; returns the compiled kernel (its `asm` holds the PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    if "UPCAST_DOT" in values:  # the launches were recorded off-GPU; compile the GPU variant
        values["UPCAST_DOT"] = False
        names = ("k_cache_ptr", "hidden_ptr", "act_ptr", "x_ptr", "w2_ptr")
        operand = next(values[name] for name in names if name in values)
        values["DOT_PRECISION"] = "ieee" if operand.dtype == torch.float32 else None
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if name in kwargs:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif type(value).__name__ == "TensorDescriptor":  # a host-side TMA descriptor
            box = ", ".join(str(n) for n in value.block_shape)
            signature[name] = f"tensordesc<{TRITON_TYPES[value.base.dtype]}[{box}]>"
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:  # the launcher turns ints equal to 1 into constants
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cuobjdump.exists():
        cubin = scratch / f"{kernel.__name__}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True
        ).stdout
        assert "STACK:0 " in usage, f"{kernel.__name__} spills registers: {usage}"
    return compiled


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_kernels_compile_for_h100_at_llama3_8b_shapes(monkeypatch, tmp_path):
    # The interpreter runs kernels as Python; this catches what only the compiler rejects.
    dtype = torch.bfloat16
    from pdserve.kernels import triton_attention, triton_kv, triton_moe, triton_norm, triton_rotary
    from pdserve.kernels.triton_ops import TRITON

    pytest.importorskip("triton.backends.nvidia")
    launches = []

    def recorder(kernel):
        def record(*args, grid, warmup, **kwargs) -> None:
            launches.append((kernel, args, kwargs))

        return record

    for module in (triton_attention, triton_kv, triton_moe, triton_norm, triton_rotary):
        for name in dir(module):
            if name.endswith("_kernel"):
                kernel = getattr(module, name)
                monkeypatch.setattr(kernel, "run", recorder(kernel))
    heads, kv_heads, head_dim, hidden = 32, 8, 128, 4096
    decode = paged_inputs([4000, 70], [1, 1], (heads, kv_heads), head_dim, 16, dtype)
    short = paged_inputs([40, 70], [1, 1], (heads, kv_heads), head_dim, 16, dtype)
    prefill = paged_inputs([2048, 90], [2048, 30], (heads, kv_heads), head_dim, 16, dtype)
    for args in (decode, short, prefill):
        TRITON.paged_attention(**args)
    qkv = torch.zeros(4, heads + 2 * kv_heads, head_dim, dtype=dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    TRITON.store_kv(k, v, decode["k_cache"], decode["v_cache"], torch.arange(4))
    TRITON.apply_rotary(q, k, torch.arange(4), torch.zeros(8, head_dim))
    x, weight = torch.zeros(4, hidden, dtype=dtype), torch.ones(hidden, dtype=dtype)
    TRITON.rms_norm(x, weight, 1e-5)
    TRITON.fused_add_rms_norm(x, x, weight, 1e-5)
    # Qwen3-30B-A3B's experts (hidden 2048, intermediate 768, 8 per token), 8 of its 128 here:
    # token counts that give each tile tier (16, 64, 128 and 512 pairs per expert; one to eight
    # tokens run `triton_moe_small`, compiled in test_triton_moe_small).
    w13, w2 = torch.empty(8, 2 * 768, 2048, dtype=dtype), torch.empty(8, 2048, 768, dtype=dtype)
    for tokens in (16, 64, 128, 512):
        weights, ids = torch.ones(tokens, 8) / 8, torch.arange(8).repeat(tokens, 1)
        triton_moe.fused_moe(torch.zeros(tokens, 2048, dtype=dtype), w13, w2, weights, ids)
    # Split decode + its reduce, single-split decode, prefill, store_kv, rotary, the two norms,
    # and each MoE's two GEMMs.
    assert len(launches) == 16
    for kernel, args, kwargs in launches:
        _compile_for_sm90(kernel, args, kwargs, tmp_path)


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_triton_ops_import_without_interpreter_and_cpu_never_loads_them():
    code = (
        "import sys\n"
        "from pdserve.kernels.ops import select_ops\n"
        "assert select_ops('cpu').name in ('torch', 'cpu')\n"
        "assert not [m for m in sys.modules if m.startswith('kernels.triton')]\n"
        "from pdserve.kernels.triton_ops import TRITON\n"
        "assert TRITON.name == 'triton'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 60
