"""Attention that sees part of the context (a sliding window, a local chunk) and attention sinks:
the torch reference against a dense computation under transformers' masks, and the CPU backends
(the C kernel, the SDPA path for long chunks) against the reference; pages no query sees, freed
(-1) or filled with NaN, change nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_inputs import (
    PATTERNS,
    attention_pattern,
    paged_inputs,
    unseen_blocks,
    with_unseen_blocks,
)

from pdserve.kernels import attention_ref, paged_attention_cpu, prefill_attention_cpu
from pdserve.kernels.ops import REFERENCE, cpu_ops

CASES = {
    # name: (context lens, query lens)
    # Contexts shorter than, equal to and just past the window and a chunk, and several long.
    "decode-only": ([1, 11, 12, 13, 16, 17, 40, 95], [1] * 8),
    # Decodes beside a whole prompt several windows long, a chunk after cached context that
    # starts mid-window and mid-chunk, and a prompt of exactly one chunk.
    "mixed": ([70, 1, 33, 50, 16], [1, 1, 33, 7, 16]),
    "chunk-after-context": ([90, 45], [20, 45]),
}
HEADS = [(4, 4), (4, 2), (8, 1)]
BLOCK_SIZES = [4, 5, 16]
LONG = prefill_attention_cpu.MIN_QUERY_TOKENS
LONG_CASES = {
    # Chunks of at least LONG queries go through SDPA, the rest through the C kernel.
    "long-prompt": ([LONG + 70], [LONG + 70]),
    "long-chunk-after-context": ([3 * LONG + 9], [LONG + 5]),
    "long-beside-decodes": ([40, 2 * LONG + 40, 9], [1, 2 * LONG, 3]),
}


def rule_mask(q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int, chunk: int) -> torch.Tensor:
    """Which keys each query sees, from the rules as transformers writes them: causal, with
    `sliding_window_overlay` (kv_idx > q_idx - window) and `chunked_overlay` (same chunk)."""
    mask = kv_idx <= q_idx
    if window:
        mask = mask & (kv_idx > q_idx - window)
    if chunk:
        mask = mask & (kv_idx // chunk == q_idx // chunk)
    return mask


def dense_sequence(q, k, v, positions, scale, window=0, chunk=0, sinks=None) -> torch.Tensor:
    """gpt-oss's eager attention over one sequence's whole K/V: q (q_len, H, D) at `positions`,
    k and v (n, H_kv, D); a sink logit per head joins each softmax and its column is dropped."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = rule_mask(positions[:, None], torch.arange(k.shape[0])[None, :], window, chunk)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = torch.full((heads,), float("-inf")) if sinks is None else sinks
    logits = torch.cat([scores, sink.view(heads, 1, 1).expand(heads, len(positions), 1)], -1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def dense_attention(inputs: dict, window=0, chunk=0, sinks=None) -> torch.Tensor:
    """Every sequence's K/V read from its whole table into one tensor, then `dense_sequence`."""
    block_size = inputs["k_cache"].shape[1]
    starts = inputs["query_start_loc"].tolist()
    out = torch.empty_like(inputs["query"])
    for b, n in enumerate(inputs["seq_lens"].tolist()):
        q0, q1 = starts[b], starts[b + 1]
        blocks = inputs["block_tables"][b, : -(-n // block_size)].long()
        k = inputs["k_cache"][blocks].flatten(0, 1)[:n]
        v = inputs["v_cache"][blocks].flatten(0, 1)[:n]
        positions = torch.arange(n - (q1 - q0), n)
        q = inputs["query"][q0:q1]
        out[q0:q1] = dense_sequence(q, k, v, positions, inputs["scale"], window, chunk, sinks)
    return out


# --- the rules and the dense computation are transformers' ---------------------------------------


@pytest.mark.parametrize("window,chunk", [(1, 0), (5, 0), (12, 0), (0, 1), (0, 7), (0, 16), (5, 7)])
def test_the_rules_are_transformers_sliding_window_and_chunked_masks(window, chunk):
    masking = pytest.importorskip("transformers.masking_utils")
    q_idx, kv_idx = torch.arange(40)[:, None], torch.arange(40)[None, :]
    parts = [masking.causal_mask_function]
    if window:
        parts.append(masking.sliding_window_overlay(window))
    if chunk:
        parts.append(masking.chunked_overlay(chunk, torch.zeros(1, dtype=torch.long)))
    theirs = masking.and_masks(*parts)(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    assert torch.equal(rule_mask(q_idx, kv_idx, window, chunk), theirs)
    # The reference's one rule: each query sees every key from its first visible one to itself.
    first = attention_ref.first_visible_keys(torch.arange(40), window, chunk)
    assert torch.equal((kv_idx >= first[:, None]) & (kv_idx <= q_idx), theirs)


def test_dense_attention_with_sinks_is_gpt_oss_eager_attention():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((9, 4), (30, 2), (30, 2)))
    sinks = torch.randn(4, generator=gen) + 2
    positions = torch.arange(21, 30)
    mask = rule_mask(positions[:, None], torch.arange(30)[None, :], 8, 0)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=2, training=False)
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]
    theirs, _ = gpt_oss.eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        bias, scaling=0.25,
    )  # fmt: skip
    ours = dense_sequence(q, k, v, positions, 0.25, window=8, sinks=sinks)
    torch.testing.assert_close(ours, theirs[0], rtol=1e-5, atol=1e-6)


# --- the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["none", *PATTERNS])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_the_reference_matches_dense_attention(pattern, case, block_size, heads):
    context, queries = CASES[case]
    inputs = paged_inputs(context, queries, heads, 16, block_size, torch.float32, seed=7)
    local = attention_pattern(pattern, heads[0]) if pattern != "none" else {}
    got = attention_ref.paged_attention(**inputs, **local)
    torch.testing.assert_close(got, dense_attention(inputs, **local), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("case", LONG_CASES)
def test_the_reference_matches_dense_attention_over_long_prompts(pattern, case):
    context, queries = LONG_CASES[case]
    inputs = paged_inputs(context, queries, (4, 2), 16, 16, torch.float32, seed=8)
    local = attention_pattern(pattern, 4)
    got = attention_ref.paged_attention(**inputs, **local)
    torch.testing.assert_close(got, dense_attention(inputs, **local), rtol=1e-5, atol=1e-5)


def test_each_pattern_changes_every_sequence_it_cuts_or_adds_a_sink_to():
    # So that a backend which ignored one would fail against the reference on these inputs.
    inputs = paged_inputs(*CASES["mixed"], (4, 2), 16, 4, torch.float32, seed=7)
    plain = attention_ref.paged_attention(**inputs)
    last = inputs["query_start_loc"][1:] - 1  # each sequence's last query
    for pattern in PATTERNS:
        local = attention_pattern(pattern, 4)
        changed = attention_ref.paged_attention(**inputs, **local)
        differs = (changed - plain)[last].abs().amax(dim=(1, 2)) > 1e-3
        cut = {k: v for k, v in local.items() if k != "sinks"}
        first = attention_ref.first_visible_keys(inputs["seq_lens"] - 1, **cut)
        assert torch.equal(differs, (first > 0) | ("sinks" in local)), pattern


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(window=-1), "window"),
        (dict(chunk=-4), "chunk"),
        (dict(sinks=torch.zeros(3)), "sinks"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_negative_window_or_chunk_and_misshapen_sinks_are_refused(backend, bad, match):
    ops = REFERENCE if backend == "torch" else cpu_ops()
    if ops is None:
        pytest.skip("no C compiler")
    inputs = paged_inputs([5], [1], (4, 2), 16, 4, torch.float32)
    with pytest.raises(ValueError, match=match):
        ops.paged_attention(**inputs, **bad)


# --- the CPU backend: the C kernel and the SDPA path ------------------------------------------

needs_kernel = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler")


@needs_kernel
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_the_c_kernel_matches_the_reference(pattern, case, block_size, heads):
    context, queries = CASES[case]
    inputs = paged_inputs(context, queries, heads, 32, block_size, torch.float32, seed=3)
    local = attention_pattern(pattern, heads[0])
    want = attention_ref.paged_attention(**inputs, **local)
    got = paged_attention_cpu.paged_attention(**inputs, **local)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("case", LONG_CASES)
@pytest.mark.parametrize("heads", HEADS)
def test_long_chunks_through_sdpa_match_the_reference(pattern, case, heads, monkeypatch):
    calls = []
    real = prefill_attention_cpu.prefill_attention
    monkeypatch.setattr(
        prefill_attention_cpu, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    context, queries = LONG_CASES[case]
    inputs = paged_inputs(context, queries, heads, 32, 16, torch.float32, seed=5)
    local = attention_pattern(pattern, heads[0])
    want = attention_ref.paged_attention(**inputs, **local)
    got = paged_attention_cpu.paged_attention(**inputs, **local)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1]


@needs_kernel
def test_a_window_wider_than_a_slice_of_sdpa_queries_matches_the_reference():
    # The SDPA path takes the queries in slices as long as the window: here longer than LONG.
    inputs = paged_inputs([3 * LONG + 9], [2 * LONG + 5], (4, 2), 32, 16, torch.float32, seed=6)
    for local in (dict(window=LONG + 20), dict(chunk=LONG + 20), dict(window=50, chunk=70)):
        want = attention_ref.paged_attention(**inputs, **local)
        got = paged_attention_cpu.paged_attention(**inputs, **local)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- pages no query sees are never read -----------------------------------------------------------

BACKENDS = {
    "torch": attention_ref.paged_attention,
    "c-kernel": paged_attention_cpu.paged_attention,
    "sdpa": paged_attention_cpu.paged_attention,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["window", "chunk", "window+sinks"])
@pytest.mark.parametrize("fill", [None, float("nan")], ids=["freed", "nan"])
def test_pages_before_every_querys_first_key_are_not_read(backend, pattern, fill):
    if backend != "torch" and not paged_attention_cpu.available():
        pytest.skip("no C compiler")
    context, queries = LONG_CASES["long-beside-decodes"] if backend == "sdpa" else CASES["mixed"]
    inputs = paged_inputs(context, queries, (4, 2), 32, 4, torch.float32, seed=9)
    local = attention_pattern(pattern, 4)
    unseen = unseen_blocks(inputs, **local)
    assert unseen[0] and (backend != "sdpa" or unseen[1])  # on the SDPA path, the long chunk's
    want = BACKENDS[backend](**inputs, **local)
    freed = with_unseen_blocks(inputs, fill=fill, **local)
    torch.testing.assert_close(BACKENDS[backend](**freed, **local), want, rtol=0, atol=0)


@needs_kernel
def test_the_op_tables_take_the_layer_pattern_and_latent_attention_still_serves():
    from pdserve.engine.execution.compiled_step import _opaque_ops
    from pdserve.kernels import mla_ref

    inputs = paged_inputs(*CASES["mixed"], (4, 2), 32, 5, torch.float32, seed=2)
    local = attention_pattern("window+sinks", 4)
    want = attention_ref.paged_attention(**inputs, **local)
    # The compiled step's custom op passes them on to the backend it wraps.
    for ops in (REFERENCE, cpu_ops(), _opaque_ops(cpu_ops())):
        torch.testing.assert_close(
            ops.paged_attention(**inputs, **local), want, rtol=1e-5, atol=1e-5
        )
    # MLA wraps each backend's paged attention with positional arguments, unchanged.
    latent = paged_inputs([20, 7], [3, 1], (4, 1), 24, 4, torch.float32, seed=3)
    args = [latent[k] for k in ("query", "k_cache", "block_tables", "seq_lens")]
    args += [latent["query_start_loc"], latent["scale"], 3]
    want = mla_ref.latent_attention(*args, 16)
    torch.testing.assert_close(cpu_ops().latent_attention(*args, 16), want, rtol=1e-5, atol=1e-5)
