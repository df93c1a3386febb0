"""The C paged-attention kernel for CPU against the torch reference (the ground truth): random
pages, ragged lengths, grouped-query heads, decodes beside prefill chunks after cached context."""

from __future__ import annotations

import pytest
import torch
from paged_inputs import paged_inputs

from pdserve.kernels import attention_ref, paged_attention_cpu, prefill_attention_cpu
from pdserve.kernels.ops import select_ops

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.available(), reason="no C compiler: the reference serves"
)

CASES = {
    # name: (context lens, query lens)
    "decode-ragged": ([1, 17, 5, 64, 33], [1, 1, 1, 1, 1]),
    "prefill-whole": ([9, 40], [9, 40]),
    "chunk-after-context": ([50, 23], [7, 23]),
    "mixed": ([70, 1, 16, 31], [1, 1, 16, 5]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_the_kernel_matches_the_reference(case, heads, block_size):
    context, queries = CASES[case]
    inputs = paged_inputs(context, queries, heads, 32, block_size, torch.float32, seed=3)
    want = attention_ref.paged_attention(**inputs)
    got = paged_attention_cpu.paged_attention(**inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the kernel's fixed sizes, and another
def test_every_head_size_matches_the_reference(head_dim):
    context, queries = CASES["mixed"]
    inputs = paged_inputs(context, queries, (4, 2), head_dim, 16, torch.float32, seed=4)
    want = attention_ref.paged_attention(**inputs)
    got = paged_attention_cpu.paged_attention(**inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_it_reads_only_the_pages_of_its_table():
    inputs = paged_inputs([20, 3], [1, 1], (2, 2), 16, 4, torch.float32, seed=1)
    before = paged_attention_cpu.paged_attention(**inputs)
    used = set(inputs["block_tables"][0, :5].tolist()) | {inputs["block_tables"][1, 0].item()}
    for block in range(inputs["k_cache"].shape[0]):
        if block not in used:
            inputs["k_cache"][block] = float("nan")
            inputs["v_cache"][block] = float("nan")
    # The last page of sequence 1 holds 3 tokens: its other slots are not read either.
    inputs["k_cache"][inputs["block_tables"][1, 0], 3:] = float("nan")
    torch.testing.assert_close(paged_attention_cpu.paged_attention(**inputs), before)


def test_threads_split_the_work_alike():
    inputs = paged_inputs([40, 7, 90], [3, 1, 1], (4, 2), 32, 16, torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_cpu.paged_attention(**inputs)
        torch.set_num_threads(2)
        two = paged_attention_cpu.paged_attention(**inputs)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_the_cpu_backend_is_chosen_on_cpu_and_other_dtypes_use_the_reference():
    assert select_ops("cpu").name == "cpu"
    assert select_ops("cpu", "torch").name == "torch"
    inputs = paged_inputs([10], [2], (2, 2), 16, 4, torch.bfloat16, seed=0)
    torch.testing.assert_close(
        paged_attention_cpu.paged_attention(**inputs), attention_ref.paged_attention(**inputs)
    )


LONG = prefill_attention_cpu.MIN_QUERY_TOKENS
LONG_CASES = {
    # Long chunks go through SDPA, the rest through the C kernel, in the same batch.
    "prefill-long": ([LONG + 30], [LONG + 30]),
    "long-chunk-after-context": ([3 * LONG], [LONG + 5]),
    "long-beside-decodes": ([40, 2 * LONG, 9, LONG], [1, 2 * LONG, 3, LONG]),
}


@pytest.mark.parametrize("case", LONG_CASES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
def test_long_prefill_chunks_match_the_reference(case, heads):
    context, queries = LONG_CASES[case]
    inputs = paged_inputs(context, queries, heads, 32, 16, torch.float32, seed=5)
    want = attention_ref.paged_attention(**inputs)
    got = paged_attention_cpu.paged_attention(**inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_long_chunk_goes_through_sdpa_and_reads_only_its_pages(monkeypatch):
    calls = []
    real = prefill_attention_cpu.prefill_attention
    monkeypatch.setattr(
        prefill_attention_cpu, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    inputs = paged_inputs([LONG + 3, 5], [LONG, 1], (4, 2), 32, 16, torch.float32, seed=6)
    before = paged_attention_cpu.paged_attention(**inputs)
    assert calls == [1]  # the long chunk; the decode went to the C kernel
    used = set(inputs["block_tables"][0, : -(-(LONG + 3) // 16)].tolist())
    used |= {inputs["block_tables"][1, 0].item()}
    for block in range(inputs["k_cache"].shape[0]):
        if block not in used:
            inputs["k_cache"][block] = float("nan")
            inputs["v_cache"][block] = float("nan")
    torch.testing.assert_close(paged_attention_cpu.paged_attention(**inputs), before)


def test_token_positions_are_derived_in_the_kernel_not_per_layer_in_python(monkeypatch):
    # Every layer of every step called it: a handful of tensor ops per layer (issue 36).
    def refuse(*args, **kwargs):
        raise AssertionError("token positions computed in Python")

    monkeypatch.setattr(paged_attention_cpu, "_token_positions", refuse)
    for context, queries in CASES.values():
        inputs = paged_inputs(context, queries, (4, 2), 32, 16, torch.float32, seed=5)
        want = attention_ref.paged_attention(**inputs)
        torch.testing.assert_close(
            paged_attention_cpu.paged_attention(**inputs), want, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize(
    "starts",
    [[0, 1, 3, 2], [0, 1, 2, 3, 4], [1, 2, 3]],  # (falling, too many tokens, not from 0)
)
def test_query_offsets_that_do_not_cover_the_tokens_in_order_are_refused(starts):
    inputs = paged_inputs([5, 6, 7], [1, 1, 1], (2, 2), 16, 4, torch.float32, seed=0)
    inputs["query_start_loc"] = torch.tensor(starts, dtype=torch.int64)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_cpu.paged_attention(**inputs)


def test_a_kernel_built_from_a_source_without_the_batch_entry_point_still_serves(tmp_path):
    # A side-by-side benchmark builds an older version of the source (bench/cpu_attention.py).
    source = paged_attention_cpu.SOURCE.read_text()
    older = tmp_path / "paged_attention_cpu.c"
    older.write_text(source[: source.index("/* The same, from the batch's")])
    library = paged_attention_cpu.build(older)
    assert not hasattr(library, "paged_attention_f32_batch")
    inputs = paged_inputs([70, 1, 16, 31], [1, 1, 16, 5], (4, 2), 32, 16, torch.float32, seed=6)
    want = attention_ref.paged_attention(**inputs)
    got = paged_attention_cpu.paged_attention(**inputs, library=library)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
