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


SMOKE = """
import json
from pdserve.bench import kernels_mixers as m
from pdserve.bench.device_limits import DeviceLimits
m.WINDOW_BATCH, m.WINDOW_CONTEXT = 2, 256
m.DELTA_BATCH, m.DELTA_PROMPT, m.DELTA_CHECKED = 2, 96, 40
m.KEY_HEADS, m.VALUE_HEADS, m.KEY_DIM, m.VALUE_DIM = 1, 2, 16, 16
limits = DeviceLimits(copy_gbps=100.0, matmul_tflops=1.0)
rows = [b(limits, lambda fn: (fn(), 1.0)[1], device="cpu")
        for b in (m.bench_window_decode, m.bench_delta_step, m.bench_delta_prefill)]
print(json.dumps([[r.mixer, r.max_abs_error, r.fraction, r.gb, r.tflop] for r in rows]))
"""


def test_the_mixer_benches_run_their_kernels_against_the_references_under_the_interpreter():
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SMOKE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    window, step, prefill = json.loads(done.stdout.strip().splitlines()[-1])
    assert window[1] <= 2e-2  # bfloat16 attention, as tests/test_triton_kernels.py allows
    assert step[1] <= 1e-5 and prefill[1] <= 1e-4  # float32 state and outputs
    # 1 ms each: the work over the made-up limits.
    assert window[2] == pytest.approx(kernels_mixers.window_kv_bytes(2, 128, 8, 128, 2) / 1e6 / 100)
    assert prefill[2] == pytest.approx(prefill[4] * 1e12 / 1e-3 / 1e12 / 1.0)
