"""The Hopper prefill attention kernel (`kernels/triton_prefill_hopper.py`) equals the torch
reference under Triton's interpreter (its TMA descriptor path included: the interpreter reads
host-side tensor descriptors), compiles for sm_90 to wgmma and TMA, and is chosen only where it
applies.

As in tests/test_triton_kernels.py, the kernel checks run in a child pytest process under
TRITON_INTERPRET=1, so the variable never reaches this process.
"""

from __future__ import annotations

import re

import pytest
import torch
from paged_inputs import paged_inputs
from test_triton_kernels import (
    ATTENTION_TOL,
    INTERPRETED,
    _compile_for_sm90,
    interpreted,
    run_interpreted,
)

from pdserve.kernels import attention_ref

pytest.importorskip("triton")
pytest.importorskip("triton.tools.tensor_descriptor")

# (dtype, (q heads, kv heads), head dim, block size, context lengths, query lengths): GQA ratios
# 1, 4 and 8, head dims 64 and 128, block sizes 16 and 32. Fresh prompts (query = context) and
# chunks over cached context; lengths that end mid-tile (a ragged last q tile and key tile) and
# mid-page, several sequences in one batch.
CASES = [
    (torch.float32, (2, 2), 64, 16, [300, 45], [300, 45]),  # causal, full tiles below diagonal
    (torch.float32, (4, 1), 128, 32, [230, 70], [50, 70]),  # chunk after 180 cached tokens
    (torch.float32, (8, 1), 64, 32, [170], [37]),  # chunk after 133, GQA 8 (16 queries a tile)
    (torch.bfloat16, (4, 1), 64, 16, [200], [200]),
    (torch.float16, (8, 1), 128, 16, [150, 20], [60, 20]),
]
CASE_IDS = [
    f"{str(c[0])[6:]}-gqa{c[1][0] // c[1][1]}-d{c[2]}-b{c[3]}-{'chunk' if c[4] != c[5] else 'fresh'}"
    for c in CASES
]


@pytest.mark.skipif(INTERPRETED, reason="this is the child process")
def test_hopper_prefill_matches_reference_under_the_triton_interpreter():
    run_interpreted(__file__)


def _inputs(case: tuple) -> dict:
    dtype, heads, head_dim, block_size, contexts, queries = case
    return paged_inputs(contexts, queries, heads, head_dim, block_size, dtype)


@interpreted
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prefill_matches_reference(case):
    from pdserve.kernels.triton_prefill_hopper import hopper_prefill_attention

    args = _inputs(case)
    # The wgmma tiles the GPU runs (hopper_prefill_config), off-GPU in the interpreter.
    out = torch.full_like(args["query"], float("nan"))
    call = {k: v for k, v in args.items() if k != "max_query_len"}
    hopper_prefill_attention(**call, out=out)
    expected = attention_ref.paged_attention(**args)
    torch.testing.assert_close(out, expected, **ATTENTION_TOL[out.dtype])


@interpreted
def test_small_tiles_cross_many_pages_and_diagonal_tiles():
    # 32 x 32 tiles: many q tiles per sequence, each with unmasked tiles below the diagonal, two
    # pages a key tile; cached context not a multiple of the tile.
    from pdserve.kernels.triton_attention import TileConfig
    from pdserve.kernels.triton_prefill_hopper import hopper_prefill_attention

    args = paged_inputs([181, 96], [101, 96], (4, 2), 64, 16, torch.float32, seed=3)
    out = torch.full_like(args["query"], float("nan"))
    call = {k: v for k, v in args.items() if k != "max_query_len"}
    config = TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    hopper_prefill_attention(**call, out=out, config=config)
    expected = attention_ref.paged_attention(**args)
    torch.testing.assert_close(out, expected, **ATTENTION_TOL[out.dtype])


@interpreted
def test_op_table_takes_the_hopper_kernel_on_sm90_for_prefill_only(monkeypatch):
    # The op table's attention on a (pretended) sm_90 device: a prefill batch launches the Hopper
    # kernel and matches the reference; a decode-only batch keeps the split-K kernel.
    from pdserve.kernels import triton_prefill_hopper
    from pdserve.kernels.triton_ops import TRITON

    assert TRITON.paged_attention is triton_prefill_hopper.paged_attention
    monkeypatch.setattr(triton_prefill_hopper, "_capability", lambda device: (9, 0))
    kernel = triton_prefill_hopper._hopper_prefill_kernel
    launches = []
    run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **k: launches.append(1) or run(*a, **k))
    prefill = paged_inputs([90], [40], (4, 1), 64, 16, torch.bfloat16, seed=1)
    out = TRITON.paged_attention(**prefill)
    assert len(launches) == 1
    torch.testing.assert_close(
        out, attention_ref.paged_attention(**prefill), **ATTENTION_TOL[out.dtype]
    )
    decode = paged_inputs([90, 33], [1, 1], (4, 1), 64, 16, torch.bfloat16, seed=1)
    out = TRITON.paged_attention(**decode)
    assert len(launches) == 1
    torch.testing.assert_close(
        out, attention_ref.paged_attention(**decode), **ATTENTION_TOL[out.dtype]
    )


# --- the choice, without CUDA -------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_hopper_kernel_applies_only_on_sm90_with_descriptors_to_full_causal_half_precision():
    from pdserve.kernels.triton_prefill_hopper import hopper_prefill_applies

    def applies(capability=(9, 0), descriptors=True, dtype=torch.bfloat16, head_dim=128, group=4,
                block_size=16, **pattern) -> bool:  # fmt: skip
        return hopper_prefill_applies(
            capability, descriptors, dtype, head_dim, group, block_size, **pattern
        )

    assert applies() and applies(capability=(10, 0)) and applies(dtype=torch.float16)
    assert applies(head_dim=64, group=8, block_size=32) and applies(group=1)
    assert not applies(capability=(8, 0))  # an A100: the portable kernel
    assert not applies(capability=(8, 9)) and not applies(capability=None)  # or no GPU at all
    assert not applies(descriptors=False)  # a Triton without tensor descriptors
    assert not applies(dtype=torch.float32)
    assert not applies(head_dim=96) and not applies(head_dim=256)
    assert not applies(group=6)  # a TMA box and the tile need a power-of-two group
    assert not applies(block_size=256)  # a page larger than a key tile
    assert not applies(window=128) and not applies(chunk=64) and not applies(has_sinks=True)


# --- sm_90 compile ------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_compiles_for_h100_to_wgmma_and_tma(monkeypatch, tmp_path):
    # Llama-3-8B attention (32 q heads over 8, head dim 128), a head dim of 64 with GQA 8 and
    # GQA 1, blocks of 16 and 32, in bfloat16 and float16: the wgmma tiles, no spills (the helper checks
    # the cubin), Q read by a TMA box, K and V by cp.async.
    from pdserve.kernels import triton_prefill_hopper

    pytest.importorskip("triton.backends.nvidia")
    kernel = triton_prefill_hopper._hopper_prefill_kernel
    launches = []

    def record(*args, grid, warmup, **kwargs) -> None:
        launches.append((args, kwargs))

    monkeypatch.setattr(kernel, "run", record)
    shapes = [
        ((32, 8), 128, 16, torch.bfloat16),
        ((64, 8), 64, 32, torch.float16),
        ((16, 16), 128, 32, torch.bfloat16),  # no GQA: a box one head deep
    ]
    for heads, head_dim, block_size, dtype in shapes:
        args = paged_inputs([2048, 90], [2048, 30], heads, head_dim, block_size, dtype)
        call = {k: v for k, v in args.items() if k != "max_query_len"}
        triton_prefill_hopper.hopper_prefill_attention(**call, out=torch.empty_like(args["query"]))
    assert len(launches) == len(shapes)
    for (args, kwargs), (_, head_dim, _, dtype) in zip(launches, shapes, strict=True):
        ptx = _compile_for_sm90(kernel, args, kwargs, tmp_path).asm["ptx"]
        kind = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
        block_n = triton_prefill_hopper.hopper_prefill_config(head_dim).block_n
        wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)", ptx))
        # QK^T over block_n keys, PV into the head dim: 64-row warpgroup tiles.
        assert {(f"m64n{block_n}k16", kind), (f"m64n{head_dim}k16", kind)} <= wgmma
        assert "cp.async.bulk.tensor" in ptx  # the Q box, by TMA
        assert "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx


# --- the GPU check's aim ------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")
def test_prefill_attention_aim_reads_the_hopper_rows_at_2k_4k_and_8k_tokens():
    # bench.kernels' rows as a GPU check records them: the Hopper kernel at 2k, 4k and 8k tokens,
    # a 16k row outside the aim. One of the three below 60% of the matmul misses the aim.
    from dataclasses import asdict

    from pdserve.bench.kernels import QUICK_SWEEP, AttentionPrefill
    from pdserve.deploy.gpu_check import aims
    from pdserve.deploy.gpu_check.runner import StepResult

    assert QUICK_SWEEP["prompt_lens"] == [2048, 4096, 8192]
    threshold = next(a.threshold for a in aims.AIMS if a.key == "prefill_attention")

    def verdicts(fraction_at_8k: float) -> list:
        rows = [
            AttentionPrefill(1, n, 1.0, None, 1.0, 800 * f, f, "hopper", 2.0)
            for n, f in ((2048, 0.7), (4096, 0.65), (8192, fraction_at_8k), (16384, 0.01))
        ]
        data = {"matmul_tflops": 800.0, "prefill": [asdict(r) for r in rows]}
        result = StepResult("kernels", "kernels", "passed", 1.0, data=data)
        return [v for v in aims.judge([result]) if v.key == "prefill_attention"]

    met = verdicts(threshold)
    assert [v.case for v in met] == [f"1 x {n} tokens (Hopper kernel)" for n in (2048, 4096, 8192)]
    assert aims.outcome(met, "prefill_attention") == aims.MET
    missed = verdicts(threshold * 0.99)
    assert aims.outcome(missed, "prefill_attention") == aims.MISSED
    assert [v.verdict for v in missed].count(aims.MISSED) == 1


# --- on CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32)])
def test_op_table_prefill_on_cuda_equals_the_reference(head_dim, block_size):
    # Llama-3-8B's heads, a fresh 1000-token prompt and a 300-token chunk after 700 cached, in
    # bfloat16 on the GPU: on sm_90 and later the Hopper kernel, elsewhere the portable one.
    from pdserve.kernels.triton_ops import TRITON

    args = paged_inputs(
        [1000, 1000], [1000, 300], (32, 8), head_dim, block_size, torch.bfloat16, device="cuda"
    )
    out = TRITON.paged_attention(**args)
    expected = attention_ref.paged_attention(**args)
    torch.testing.assert_close(out, expected, **ATTENTION_TOL[torch.bfloat16])
