"""Rotary embedding on CPU without concatenations gives exactly the reference's results."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import paged_attention_cpu, rotary_cpu, rotary_ref
from pdserve.kernels.ops import select_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 4, 16), (7, 8, 2, 32), (130, 6, 2, 128)])
def test_it_equals_the_reference_bit_for_bit(shape, dtype):
    tokens, heads, kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    cache = torch.randn(512, head_dim, generator=g)
    want = rotary_ref.apply_rotary(q, k, positions, cache)
    got = rotary_cpu.apply_rotary(q, k, positions, cache)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_cpu_backend_uses_it():
    if not paged_attention_cpu.available():
        pytest.skip("no C compiler: the cpu backend is the reference")
    assert select_ops("cpu").apply_rotary is rotary_cpu.apply_rotary
