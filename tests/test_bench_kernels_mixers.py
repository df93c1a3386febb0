"""The byte and FLOP counts bench/kernels_mixers.py divides by its times (the timings themselves
need CUDA): worked by hand, and the chunked Gated DeltaNet count against torch's FLOP counter
on the reference the engine runs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pdserve.bench import kernels, kernels_mixers
from pdserve.kernels import gated_delta_ref


def test_window_decode_reads_only_the_window():
    # 2 sequences x 4 keys x K,V x 1 head x 2 dims x 2 bytes, whatever the context.
    assert kernels_mixers.window_kv_bytes(2, 4, 1, 2, 2) == 64


def test_delta_step_reads_and_writes_each_float32_state():
    # 1 sequence x 2 value heads x a 3 x 4 state x 4 bytes, read and written.
    assert kernels_mixers.delta_step_bytes(1, 2, 3, 4) == 192


@pytest.mark.parametrize("length", [100, 128])
def test_chunked_delta_flop_is_the_references_matmuls_and_its_solves(length):
    chunk, v_heads, k_dim, v_dim = 16, 2, 8, 4
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(length, 1, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(length, v_heads, v_dim, generator=gen)
    g, beta = (
        -torch.rand(length, v_heads, generator=gen),
        torch.rand(length, v_heads, generator=gen),
    )
    state = torch.zeros(v_heads, k_dim, v_dim)
    with FlopCounterMode(display=False) as counter:
        gated_delta_ref.chunked_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    # torch counts the matmuls; the two triangular solves (C^2 multiply-adds per column of u's
    # value columns and w's key columns) it does not.
    chunks = -(-length // chunk)
    solves = chunks * v_heads * chunk * chunk * (v_dim + k_dim)
    got = kernels_mixers.delta_chunked_flop(length, v_heads, k_dim, v_dim, chunk)
    assert got == counter.get_total_flops() + solves


def test_mixers_are_skipped_on_request_and_the_flag_parses():
    # Without CUDA the script says so and exits 0 before timing anything, either way.
    assert kernels.main(["--quick", "--no-mixers"]) == 0
    assert kernels.main(["--quick"]) == 0


def test_gpu_check_report_shows_the_mixers_rows():
    from dataclasses import asdict

    from pdserve.deploy.gpu_check.report import details_kernels
    from pdserve.deploy.gpu_check.runner import StepResult

    row = kernels_mixers.MixerRow("window decode", "batch 2", 0.5, 2.0, 0.1, 0.0, 0.81, 3e-3)
    data = {"copy_gbps": 4000.0, "matmul_tflops": 700.0, "decode": [], "prefill": []}
    without = details_kernels(StepResult("kernels", "k", "passed", data=data))
    data["mixers"] = [asdict(row)]
    lines = details_kernels(StepResult("kernels", "k", "passed", data=data))
    assert lines[: len(without)] == without  # the decode and prefill tables keep their places
    assert "| window decode | batch 2 | 0.500 | 2.000 | 81% of copy | 3.0e-03 |" in lines
