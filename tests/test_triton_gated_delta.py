"""The Triton one-token gated delta rule equals its torch reference (`gated_delta_ref`), checked
on CPU through Triton's interpreter in a child process (as tests/test_triton_kernels.py runs the
other kernels): key heads serving several value heads or one, head dims that are and are not
powers of two and tiles of value dims, float32 and bfloat16 inputs, states carried over steps."""

from __future__ import annotations

import os

import pytest
import torch
from test_triton_kernels import INTERPRETED, interpreted, run_interpreted

from pdserve.kernels import gated_delta_ref

pytestmark = pytest.mark.slow

pytest.importorskip("triton")

# (sequences, key heads, value heads, key dim, value dim)
SHAPES = [(3, 2, 4, 16, 16), (2, 2, 2, 32, 48), (5, 1, 3, 12, 20), (1, 4, 8, 128, 64)]


@pytest.mark.skipif(INTERPRETED, reason="this is the child process")
def test_the_kernel_matches_the_reference_under_the_triton_interpreter():
    run_interpreted(os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__))))


def inputs(n, hk, hv, dk, dv, dtype, seed=0):  # noqa: ANN001, ANN201
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hk, dk, generator=gen).to(dtype)
    k = torch.randn(n, hk, dk, generator=gen).to(dtype)
    v = torch.randn(n, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(n, hv, generator=gen)  # log decay, <= 0
    beta = torch.rand(n, hv, generator=gen).to(dtype)
    state = torch.randn(n, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@interpreted
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-k{}-v{}-dk{}-dv{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_step_matches_the_reference(shape, dtype):
    from pdserve.kernels.triton_gated_delta import gated_delta_step

    args = inputs(*shape, dtype)
    out, state = gated_delta_step(*args)
    want_out, want_state = gated_delta_ref.gated_delta_step(*args)
    assert out.dtype == state.dtype == torch.float32
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)


@interpreted
def test_steps_carry_the_state_as_the_reference_does():
    from pdserve.kernels.triton_gated_delta import gated_delta_step

    *_, state = inputs(2, 2, 4, 16, 8, torch.float32)
    want = state.clone()
    for step in range(4):
        q, k, v, g, beta, _ = inputs(2, 2, 4, 16, 8, torch.float32, seed=step + 1)
        out, state = gated_delta_step(q, k, v, g, beta, state)
        want_out, want = gated_delta_ref.gated_delta_step(q, k, v, g, beta, want)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want, atol=1e-5, rtol=1e-5)
