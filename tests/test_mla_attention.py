"""Multi-head latent attention's absorbed form (multi-query attention over the latent pages,
what the engine runs) equals DeepSeek's decompressed per-head form, on prefill, decode and mixed
batches, through the torch reference and the CPU kernel backend; latents land in their slots."""

from __future__ import annotations

import pytest
import torch
from paged_inputs import paged_inputs

from pdserve.kernels import mla_ref
from pdserve.kernels.ops import REFERENCE, cpu_ops

LORA, ROPE, NOPE, V_DIM, HEADS = 32, 8, 16, 24, 4
BACKENDS = {
    "torch": REFERENCE,
    "cpu": cpu_ops() or pytest.skip("no C kernel", allow_module_level=True),
}

CASES = {
    "prefill": ([13, 30], [13, 30]),  # whole prompts
    "chunked": ([21, 40], [5, 17]),  # the last tokens of longer contexts
    "decode": ([1, 9, 33], [1, 1, 1]),
    "mixed": ([7, 26, 12], [1, 8, 1]),
}


def _case(context_lens, query_lens, block_size, dtype):  # noqa: ANN001, ANN202
    inputs = paged_inputs(
        context_lens, query_lens, (HEADS, 1), LORA + ROPE, block_size, dtype, seed=5
    )
    gen = torch.Generator().manual_seed(9)
    tokens = inputs["query"].shape[0]
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=gen).to(dtype)
    q_pe = torch.randn(tokens, HEADS, ROPE, generator=gen).to(dtype)
    w_uk = (torch.randn(HEADS, NOPE, LORA, generator=gen) / LORA**0.5).to(dtype)
    w_uv = (torch.randn(HEADS, V_DIM, LORA, generator=gen) / LORA**0.5).to(dtype)
    return inputs, q_nope, q_pe, w_uk, w_uv


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_absorbed_attention_equals_the_decompressed_form(backend, block_size, case):
    inputs, q_nope, q_pe, w_uk, w_uv = _case(*CASES[case], block_size, torch.float32)
    scale = (NOPE + ROPE) ** -0.5
    cache = inputs["k_cache"]
    query = torch.cat([mla_ref.absorb_query(q_nope, w_uk), q_pe], dim=-1)
    out_lat = BACKENDS[backend].latent_attention(
        query,
        cache,
        inputs["block_tables"],
        inputs["seq_lens"],
        inputs["query_start_loc"],
        scale,
        inputs["max_query_len"],
        LORA,
    )
    assert out_lat.shape == (query.shape[0], HEADS, LORA)
    absorbed = mla_ref.expand_output(out_lat, w_uv)
    decompressed = mla_ref.decompressed_attention(
        q_nope,
        q_pe,
        cache,
        w_uk,
        w_uv,
        inputs["block_tables"],
        inputs["seq_lens"],
        inputs["query_start_loc"],
        scale,
    )
    torch.testing.assert_close(absorbed, decompressed, rtol=1e-4, atol=1e-5)


def test_the_rotary_key_part_counts_in_the_scores():
    # The decompressed form with k_pe zeroed differs: the latent's last R numbers are used.
    inputs, q_nope, q_pe, w_uk, w_uv = _case([9, 33], [1, 1], 4, torch.float32)
    args = (inputs["block_tables"], inputs["seq_lens"], inputs["query_start_loc"], 0.2)
    whole = mla_ref.decompressed_attention(q_nope, q_pe, inputs["k_cache"], w_uk, w_uv, *args)
    no_pe = inputs["k_cache"].clone()
    no_pe[..., LORA:] = 0
    without = mla_ref.decompressed_attention(q_nope, q_pe, no_pe, w_uk, w_uv, *args)
    assert not torch.allclose(whole, without, atol=1e-3)


def test_store_latent_writes_slots_and_skips_padding():
    cache = torch.zeros(4, 4, 1, LORA + ROPE)
    latent = torch.randn(3, 1, LORA + ROPE)
    mla_ref.store_latent(latent, cache, torch.tensor([5, -1, 14]))
    flat = cache.view(16, LORA + ROPE)
    assert torch.equal(flat[5], latent[0, 0])
    assert torch.equal(flat[14], latent[2, 0])
    assert int((flat.abs().sum(-1) > 0).sum()) == 2
