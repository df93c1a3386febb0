"""On CUDA, the engine running the Triton kernels generates what the CPU reference generates, the
sampler on the device picks what it picks on the host (seeded rows whatever the batch), and each
compiled kernel matches its torch reference at serving shapes (long contexts, Llama-3 heads).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from paged_inputs import paged_inputs

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sampler import hash32, sample, seeded_noise
from pdserve.engine.sequence import Sequence
from pdserve.kernels import attention_ref, moe_ref, norm_ref, rotary_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW_TOKENS = 24
# GPU exp2 is approximate (a couple of float32 ulps) and contexts here run to thousands of keys.
ATTENTION_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _prompts() -> list[list[int]]:
    prompts = random_prompts(3, [3, 17, 40, 75])
    # Shares 48 tokens (three 16-token blocks) with the previous prompt: a prefix-cache hit.
    prompts.append(prompts[-1][:48] + random_prompts(4, [9])[0])
    return prompts


def _generate(model: str | None, device: str, **options: object) -> list[list[int]]:
    llm = LLM(model, device=device, dtype="float32", **options)
    if device == "cuda":
        assert llm.engine.ops.name == "triton"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(_prompts(), params)]


# --- the engine end to end ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_engine_greedy_matches_cpu_reference(checkpoint_dir, family, block_size):
    # A 32-token budget chunks the longer prompts, so extend steps read earlier chunks' pages.
    model = str(checkpoint_dir(family))
    options = dict(block_size=block_size, num_kv_blocks=2048 // block_size)
    options["max_num_batched_tokens"] = 32
    expected = _generate(model, "cpu", **options)
    assert _generate(model, "cuda", kernel_backend="triton", **options) == expected


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_linear_attention_hybrids_on_cuda_match_cpu_reference(checkpoint_dir, family):
    """Gated DeltaNet layers on CUDA (their decode step the Triton kernel, states in the pool's
    pages, segments cut at block boundaries) generate the CPU reference's tokens, chunked and
    with a prefix hit restoring a state snapshot."""
    model = str(checkpoint_dir(family))
    options = dict(block_size=16, num_kv_blocks=256, max_num_batched_tokens=32)
    expected = _generate(model, "cpu", **options)
    assert _generate(model, "cuda", kernel_backend="triton", **options) == expected


def test_triton_engine_on_the_default_tiny_model_matches_cpu_reference():
    options = dict(num_kv_blocks=256)
    expected = _generate(None, "cpu", **options)
    assert _generate(None, "cuda", kernel_backend="triton", **options) == expected


def _generate_staggered(model: str, device: str, **options: object) -> tuple[list, LLM]:
    """Different output lengths, so the decode batch shrinks through several captured sizes."""
    llm = LLM(model, device=device, dtype="float32", **options)
    prompts = _prompts() + random_prompts(5, [6, 23, 51])
    params = [
        SamplingParams(max_tokens=4 + 5 * i, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return [o.token_ids for o in llm.generate(prompts, params)], llm


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graph_decode_matches_cpu_reference(checkpoint_dir, family, enforce_eager):
    # 8 sequences: graphs of 1, 2, 4 and 6 rows, so 8 and 7 run eagerly, 5 and 6 replay size 6, 3 and
    # 4 replay size 4: padded replays, an eager fallback, and the prefill steps between them.
    model = str(checkpoint_dir(family))
    options = dict(num_kv_blocks=512, max_num_batched_tokens=64)
    expected, _ = _generate_staggered(model, "cpu", **options)
    got, llm = _generate_staggered(
        model,
        "cuda",
        kernel_backend="triton",
        enforce_eager=enforce_eager,
        cuda_graph_max_batch_size=6,
        **options,
    )
    assert got == expected
    graphs = llm.engine.runner.decode_graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs.sizes == [1, 2, 4, 6] and graphs.replays > 0
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_reference_backend_on_cuda_runs_eagerly():
    llm = LLM(None, device="cuda", dtype="float32", kernel_backend="torch", num_kv_blocks=64)
    assert llm.engine.ops.name == "torch" and llm.engine.runner.decode_graphs is None


def test_bfloat16_is_the_default_on_cuda():
    llm = LLM(None, device="cuda", num_kv_blocks=64)
    assert llm.engine.pool.kv.dtype == torch.bfloat16
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16


# --- sampling on the device ---------------------------------------------------------------------


def _decoding(request_id: str, params: SamplingParams, outputs: int = 3, **kw: int) -> Sequence:
    seq = Sequence(request_id, [5, 17, 17, 40], params, **kw)
    for token in range(outputs):
        seq.append_token(17 + token)
    return seq


def test_greedy_sampling_on_cuda_picks_the_cpu_tokens():
    gen = torch.Generator().manual_seed(11)
    logits = 4 * torch.randn(48, 32000, generator=gen)
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.9, top_k=1, seed=3),
    ]
    seqs = [_decoding(f"g{i}", kinds[i % len(kinds)]) for i in range(48)]
    on_cpu = sample(logits.clone(), seqs)
    on_cuda = sample(logits.cuda(), seqs)
    assert on_cuda.token_ids == on_cpu.token_ids
    for got, expected in zip(on_cuda.logprobs, on_cpu.logprobs):
        assert (got is None) == (expected is None)
        if got is not None:
            assert got["token"][0] == expected["token"][0]
            assert [t for t, _ in got["top"]] == [t for t, _ in expected["top"]]
            torch.testing.assert_close(
                torch.tensor([got["token"][1]] + [v for _, v in got["top"]]),
                torch.tensor([expected["token"][1]] + [v for _, v in expected["top"]]),
            )


def test_seeded_sampling_on_cuda_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(6, 32000, generator=gen).cuda()
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=2**40 + 9)
    alone = sample(logits[4:5].clone(), [_decoding("alone", seeded, output_offset=2)])
    companions = [
        _decoding("a", SamplingParams(temperature=0)),
        _decoding("b", SamplingParams(temperature=0.8, repetition_penalty=1.2)),
        _decoding("c", SamplingParams(temperature=1.0, seed=1)),
        _decoding("d", SamplingParams(temperature=1.0, top_k=20, logprobs=2)),
        _decoding("e", seeded, output_offset=2),
        _decoding("f", SamplingParams(temperature=1.3)),
    ]
    for unseeded_noise in (0, 1):  # the device generator's state must not reach the seeded row
        torch.cuda.manual_seed(unseeded_noise)
        assert sample(logits.clone(), companions).token_ids[4] == alone.token_ids[0]


def test_seeded_noise_is_the_same_function_on_cuda_and_cpu():
    values = torch.randint(0, 2**32, (10_000,), dtype=torch.long, generator=torch.Generator())
    expected = hash32(values.clone())  # in place
    assert torch.equal(hash32(values.cuda()).cpu(), expected)
    seeds, indexes = [0, 7, -3, 2**50], [0, 1, 9, 4096]
    torch.testing.assert_close(
        seeded_noise(seeds, indexes, 5000, torch.device("cuda")).cpu(),
        seeded_noise(seeds, indexes, 5000, torch.device("cpu")),
    )


def test_seeded_generation_on_cuda_does_not_depend_on_batch_companions():
    llm = LLM(None, device="cuda", dtype="float32", num_kv_blocks=256)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    prompt = "Once upon a time"
    (alone,) = llm.generate([prompt], params)
    others = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    batched = llm.generate(["noise one", prompt, "more noise here"], [others, params, others])
    assert batched[1].token_ids == alone.token_ids


# --- kernels at serving shapes ------------------------------------------------------------------


def _check_attention(args: dict) -> None:
    from pdserve.kernels.triton_ops import TRITON

    got = TRITON.paged_attention(**args)
    expected = attention_ref.paged_attention(**args)
    torch.testing.assert_close(got, expected, **ATTENTION_TOL[got.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((8, 1), 64), ((16, 16), 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_attention_matches_reference_at_long_contexts(dtype, heads, head_dim, block_size):
    contexts = [1, 15, 16, 17, 500, 1023, 2048, 4097]
    _check_attention(
        paged_inputs(
            contexts, [1] * len(contexts), heads, head_dim, block_size, dtype, device="cuda"
        )
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((8, 1), 64)])
def test_prefill_attention_matches_reference_on_a_mixed_batch(dtype, heads, head_dim):
    # A 2k prompt, a chunk after 1000 cached tokens, decodes, and a chunk after an aligned prefix.
    contexts, queries = [2048, 1300, 700, 33, 512], [2048, 300, 1, 1, 256]
    _check_attention(paged_inputs(contexts, queries, heads, head_dim, 16, dtype, device="cuda"))


def test_decode_attention_replays_in_a_cuda_graph():
    from pdserve.kernels.triton_ops import TRITON

    args = paged_inputs(
        [4000, 3000, 2500, 900], [1] * 4, (32, 8), 128, 16, torch.bfloat16, device="cuda"
    )
    TRITON.paged_attention(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON.paged_attention(**args)
    graph.replay()
    torch.testing.assert_close(
        out, attention_ref.paged_attention(**args), **ATTENTION_TOL[torch.bfloat16]
    )
    # New lengths, pages and queries written into the captured buffers: the replay follows them.
    args["seq_lens"].copy_(torch.tensor([17, 2999, 1, 900]))
    args["block_tables"][0, :250] = args["block_tables"][0, :250].flip(0)
    args["query"].normal_()
    graph.replay()
    torch.testing.assert_close(
        out, attention_ref.paged_attention(**args), **ATTENTION_TOL[torch.bfloat16]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_norms_and_rotary_match_reference_at_model_shapes(dtype):
    from pdserve.kernels.triton_ops import TRITON

    gen = torch.Generator(device="cuda").manual_seed(5)
    tokens, num_heads, num_kv_heads, head_dim, hidden = 300, 32, 8, 128, 4096

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    # store_kv from strided views of a fused qkv, with padding slots.
    qkv = randn(tokens, num_heads + 2 * num_kv_heads, head_dim)
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:tokens]
    slots[::7] = -1
    caches = [
        torch.zeros(64, 16, num_kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(4)
    ]
    attention_ref.store_kv(key, value, caches[0], caches[1], slots)
    TRITON.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])

    # Rotary rounds where the reference rounds: bit for bit in half precision.
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    freqs = torch.arange(8192, device="cuda")[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    q, k = qkv[:, :num_heads], key
    expected_q, expected_k = rotary_ref.apply_rotary(q.clone(), k.clone(), positions, cos_sin)
    TRITON.apply_rotary(q, k, positions, cos_sin)
    if dtype == torch.float32:
        torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)

    # Norms: the reductions sum in another order, so the normalised value, rounded to the dtype
    # before the weight (in [0.5, 1.5)) multiplies it, may be a unit in the last place off: two
    # units of the output at most (one was not enough for float16 on an H200).
    x, residual = randn(tokens, hidden), randn(tokens, hidden)
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype)
    tol = {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.float16: dict(atol=1e-5, rtol=2 * 2**-10),
        torch.bfloat16: dict(atol=1e-5, rtol=2 * 2**-7),
    }[dtype]
    torch.testing.assert_close(
        TRITON.rms_norm(x, weight, 1e-5), norm_ref.rms_norm(x, weight, 1e-5), **tol
    )
    normed, summed = TRITON.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **tol)


# The fused MoE against the reference at a 64-expert layer's shapes (hidden 2048, intermediate 768,
# 8 experts per token), outputs of magnitude up to ~2. Both round at the same five points, to
# nearest; summation order alone may tip a rounding, which moves an output by a unit or two in
# the last place, allowed here up to ~4. Worst seen on an H200 in bfloat16, 1 to 4096 tokens:
# 3.9e-3 (half a unit near 1.7).
MOE_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=4e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
}


def _moe_inputs(num_tokens: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    hidden_size, inter_size, num_experts, top_k = 2048, 768, 64, 8

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    probs = torch.softmax(torch.randn(num_tokens, num_experts, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return dict(
        hidden=randn(num_tokens, hidden_size),
        w13=randn(num_experts, 2 * inter_size, hidden_size, scale=hidden_size**-0.5),
        w2=randn(num_experts, hidden_size, inter_size, scale=inter_size**-0.5),
        topk_weights=weights / weights.sum(dim=-1, keepdim=True),
        topk_ids=ids,
    )


@pytest.mark.parametrize(
    "dtype,num_tokens",
    [(torch.bfloat16, 1), (torch.bfloat16, 8), (torch.bfloat16, 64), (torch.bfloat16, 512)]
    + [(torch.float16, 64), (torch.float32, 3), (torch.float32, 64)],
    ids=[
        "bfloat16-1",
        "bfloat16-8",
        "bfloat16-64",
        "bfloat16-512",
        "float16-64",
        "float32-3",
        "float32-64",
    ],
)
def test_fused_moe_matches_reference_and_replays_in_a_cuda_graph(dtype, num_tokens):
    from pdserve.kernels.triton_moe import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(7)
    args = _moe_inputs(num_tokens, dtype, gen)
    eager = fused_moe(**args)  # compile outside the capture
    torch.testing.assert_close(eager, moe_ref.fused_moe(**args), **MOE_TOL[dtype])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(**args)
    graph.replay()
    assert torch.equal(out, eager)
    # New tokens and routes written into the captured buffers: the replay follows them.
    fresh = _moe_inputs(num_tokens, dtype, gen)
    for name in ("hidden", "topk_weights", "topk_ids"):
        args[name].copy_(fresh[name])
    graph.replay()
    torch.testing.assert_close(out, moe_ref.fused_moe(**args), **MOE_TOL[dtype])
