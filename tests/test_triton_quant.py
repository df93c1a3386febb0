"""The Triton GEMMs for quantized weights equal their torch references (`w4a16_ref`,
`fp8_block_ref`, `moe_ref` on dequantized experts), checked on CPU through Triton's interpreter in
a child process as `test_triton_kernels` runs its kernels, and each compiles for sm_90 without
register spills (the FP8 kernel's prefill tile on FP8 tensor cores, its W8A16 variant for sm_80
too).

The interpreter runs float8 tensors (numpy-backed, their dots exact) but casts float32 to float8
wrongly when rounding carries into the exponent; the kernels round onto the e4m3 grid by bit
arithmetic first, so the interpreter runs the very code a GPU runs. What it cannot prove: the
speed, and the GPU's own tensor-core numerics (checked on a lent GPU by `make gpu-check`).
"""

from __future__ import annotations

import re

import pytest
import torch
from test_triton_kernels import INTERPRETED, _compile_for_sm90, interpreted, run_interpreted

from pdserve.engine.quant.fp8_reference import quantize as fp8_quantize
from pdserve.kernels import moe_ref
from pdserve.kernels.fp8_block_ref import (
    dequantize_blocks,
    fp8_block_matmul_ref,
    quantize_activations,
)
from pdserve.kernels.w4a16_ref import pack_int4, w4a16_matmul_ref

pytestmark = pytest.mark.slow

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from pdserve.kernels.triton_e4m3 import e4m3_to_float32, round_to_e4m3  # noqa: E402

# Outputs here are of magnitude up to ~8. float32: both sides multiply the same float32 values
# and differ only in summation order (worst seen 1.0e-6). bfloat16 and float16: the kernels
# round each dequantized weight to the activations' dtype before the dot (as a GPU must, for its
# tensor cores) and round the output, where the reference keeps float32 throughout; the
# interpreter rounds to bfloat16 by truncation, so two units in the last place (worst seen:
# bfloat16 6.3e-2 near 7.5, float16 3.9e-3 near 6).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
    torch.float16: dict(atol=6e-3, rtol=2e-3),
}


def test_kernels_match_references_under_the_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this is the child process")
    run_interpreted(__file__)


# --- e4m3 by bit arithmetic ----------------------------------------------------------------------


@triton.jit
def _decode_kernel(bits_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, e4m3_to_float32(tl.load(bits_ptr + i)))


@triton.jit
def _cast_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, round_to_e4m3(tl.load(x_ptr + i)).to(tl.float8e4nv))


@interpreted
def test_e4m3_bytes_decode_and_float32_rounds_exactly_as_torch_casts():
    every_byte = torch.arange(256, dtype=torch.uint8)
    decoded = torch.empty(256)
    _decode_kernel[(1,)](every_byte, decoded, 256)
    expected = every_byte.view(torch.float8_e4m3fn).float()
    finite = ~expected.isnan()  # 0x7f and 0xff: quantizers never write NaN
    assert torch.equal(decoded[finite], expected[finite])
    # Magnitudes across e4m3's range (subnormals below 2**-6), ties, and rounding that carries
    # into the next exponent (31.9 -> 32: the case the interpreter's own cast gets wrong).
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 2.0 ** torch.randint(-12, 9, (4096,), generator=gen)
    x[:6] = torch.tensor([31.9, -125.5, 2**-10, 3 * 2**-10, 448.0, 0.0])
    x = x.clamp(-448, 448)
    rounded = torch.empty(4096, dtype=torch.float8_e4m3fn)
    _cast_kernel[(1,)](x, rounded, 4096)
    assert torch.equal(rounded.float(), x.to(torch.float8_e4m3fn).float())


# --- W4A16 --------------------------------------------------------------------------------------


def w4a16_inputs(m: int, n: int, k: int, group: int, zeros: bool, dtype: torch.dtype, seed=0):
    """Random 4-bit weights with group scales (and zero points), packed; x of unit scale."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale_dtype = torch.float16 if dtype == torch.float32 else dtype
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.01).to(scale_dtype)
    z = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8) if zeros else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, pack_int4(q), scales, z


# (M, N, K, group, zero points, dtype): M = 1, 3, 33; N and K off every tile (K = 203 ends mid
# word, 200 mid group); groups of 32 and 128, and one spanning the row (channel-wise scales).
W4A16_CASES = [
    (1, 40, 203, 32, True, torch.float32),
    (3, 72, 264, 128, False, torch.float32),
    (33, 40, 200, 128, True, torch.bfloat16),
    (3, 24, 136, 32, False, torch.float16),
    (33, 24, 136, 32, True, torch.float16),
    (1, 24, 200, 200, False, torch.bfloat16),
]


@interpreted
@pytest.mark.parametrize("m, n, k, group, zeros, dtype", W4A16_CASES, ids=str)
def test_w4a16_matches_reference(m, n, k, group, zeros, dtype):
    from pdserve.kernels.triton_w4a16 import w4a16_matmul

    x, qweight, scales, z = w4a16_inputs(m, n, k, group, zeros, dtype)
    out = w4a16_matmul(x, qweight, scales, z, group)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, w4a16_matmul_ref(x, qweight, scales, z, group), **TOL[dtype])


@interpreted
def test_w4a16_refuses_a_group_size_it_cannot_step_through():
    from pdserve.kernels.triton_w4a16 import w4a16_matmul

    x, qweight, scales, z = w4a16_inputs(1, 16, 96, 24, True, torch.float32)
    with pytest.raises(ValueError, match="group_size 24"):
        w4a16_matmul(x, qweight, scales, z, 24)


# --- FP8 block-scaled ---------------------------------------------------------------------------


def fp8_inputs(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed=0):
    """A weight quantized to FP8 blocks as checkpoints are, and x of unit scale."""
    gen = torch.Generator().manual_seed(seed)
    weight, scale_inv = fp8_quantize(torch.randn(n, k, generator=gen) * k**-0.5, block)
    return torch.randn(m, k, generator=gen).to(dtype), weight, scale_inv


# (M, N, K, block, dtype): N and K end in ragged blocks and off the tiles; DeepSeek-V3's 128 x 128
# blocks once, smaller ones for more blocks per tile.
FP8_CASES = [
    (1, 40, 200, (16, 32), torch.float32),
    (3, 72, 136, (32, 64), torch.bfloat16),
    (33, 136, 264, (128, 128), torch.bfloat16),
    (3, 40, 96, (16, 32), torch.float16),
]


@interpreted
@pytest.mark.parametrize("m, n, k, block, dtype", FP8_CASES, ids=str)
def test_fp8_block_matmul_matches_the_reference_that_quantizes_activations_alike(
    m, n, k, block, dtype
):
    from pdserve.kernels.triton_fp8_block import fp8_block_matmul

    x, weight, scale_inv = fp8_inputs(m, n, k, block, dtype)
    out = fp8_block_matmul(x, weight, scale_inv, block)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, fp8_block_matmul_ref(x, weight, scale_inv, block), **TOL[dtype])
    # Against the unquantized activations the difference is the activations' rounding to e4m3:
    # at most 2**-4 of each product (normal e4m3 numbers), so 2**-4 of |x| @ |W|^T, plus the
    # output's rounding.
    exact = fp8_block_matmul_ref(x, weight, scale_inv, block, quantize_x=False).float()
    bound = 2**-4 * (x.float().abs() @ dequantize_blocks(weight, scale_inv, block).abs().T)
    error = (out.float() - exact).abs()
    assert (error <= bound + TOL[dtype]["atol"] + TOL[dtype]["rtol"] * exact.abs()).all()
    assert error.max() > 0  # the activations were quantized


@interpreted
@pytest.mark.parametrize("m, n, k, block, dtype", FP8_CASES, ids=str)
def test_w8a16_block_matmul_matches_the_dequantized_reference(m, n, k, block, dtype):
    from pdserve.kernels.triton_fp8_block import w8a16_block_matmul

    x, weight, scale_inv = fp8_inputs(m, n, k, block, dtype)
    out = w8a16_block_matmul(x, weight, scale_inv, block)
    expected = fp8_block_matmul_ref(x, weight, scale_inv, block, quantize_x=False)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@interpreted
@pytest.mark.parametrize("gemm", ["fp8", "w8a16"])
def test_fp8_linear_with_ragged_fused_parts_runs_the_kernel_its_device_chooses(monkeypatch, gemm):
    # q/k/v-like parts of 40, 24 and 8 rows in blocks of 16: each part's last block is ragged
    # and keeps its own scale row, so the kernel reads each row's scale row from the layer.
    from pdserve.engine.quant import fp8_linear
    from pdserve.engine.quant.gemm_choice import Fp8Gemm

    parts, block, k = (40, 24, 8), (16, 32), 72
    layer = fp8_linear.Fp8Linear(k, parts, bias=True, block=block)
    gen = torch.Generator().manual_seed(3)
    quantized = [fp8_quantize(torch.randn(n, k, generator=gen) * 0.1, block) for n in parts]
    with torch.no_grad():
        layer.weight.copy_(torch.cat([w for w, _ in quantized]))
        layer.weight_scale_inv.copy_(torch.cat([s for _, s in quantized]))
        layer.bias.copy_(torch.randn(sum(parts), generator=gen))
    x = torch.randn(2, 3, k, generator=gen)
    weight = layer.dequantized(torch.float32)
    if gemm == "fp8":  # the reference of the FP8 path: the activations quantized alike
        xq, scales = quantize_activations(x.view(-1, k), block[1])
        expected = (xq.float() * scales.repeat_interleave(block[1], 1)[:, :k]).view(2, 3, k)
        expected = torch.nn.functional.linear(expected, weight, layer.bias)
    else:
        expected = torch.nn.functional.linear(x, weight, layer.bias)
    monkeypatch.setattr(fp8_linear, "fp8_gemm_on", lambda device: Fp8Gemm(gemm))
    out = layer(x)
    assert out.shape == (2, 3, sum(parts))
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


# --- FP8 experts in the fused MoE ---------------------------------------------------------------


def fp8_experts(experts: int, hidden: int, inter: int, block: tuple[int, int], seed=0):
    """Stacked FP8 experts as checkpoints store them (gate and up quantized apart, each with its
    own scale rows) and their dequantized float32 weights for the reference."""
    gen = torch.Generator().manual_seed(seed)

    def stack(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qs = [
            fp8_quantize(torch.randn(rows, cols, generator=gen) * 0.1, block)
            for _ in range(experts)
        ]
        w, s = torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
        return w, s, dequantize_blocks(w, s, block)

    gate, up, down = stack(inter, hidden), stack(inter, hidden), stack(hidden, inter)
    w13, w13_scale = torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1)
    return (w13, w13_scale, down[0], down[1]), (torch.cat([gate[2], up[2]], 1), down[2])


# Experts of hidden 80 and width 40 in blocks of (16, 32): the width ends mid block (so gate and up
# keep separate scale rows) and both reductions end in ragged K blocks.
MOE_CASES = [(torch.float32, 5), (torch.bfloat16, 3)]
# float32 as above; bfloat16 also rounds the reference's dequantized weights, where the kernel
# multiplies the exact FP8 values and scales after the dot (worst seen 1.2e-2 at ~0.6).
MOE_TOL = {torch.float32: TOL[torch.float32], torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@interpreted
@pytest.mark.parametrize("dtype, tokens", MOE_CASES, ids=str)
def test_fused_moe_with_fp8_experts_matches_the_reference_on_dequantized_weights(dtype, tokens):
    from pdserve.kernels.triton_moe_fp8 import fused_moe_fp8

    block, top_k = (16, 32), 2
    (w13, w13_scale, w2, w2_scale), (w13_f, w2_f) = fp8_experts(4, 80, 40, block)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 80, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(tokens, 4, generator=gen).softmax(-1), top_k)
    out = fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, weights, ids, block)
    expected = moe_ref.fused_moe(x, w13_f.to(dtype), w2_f.to(dtype), weights, ids)
    assert out.dtype == dtype and out.shape == (tokens, 80)
    torch.testing.assert_close(out, expected, **MOE_TOL[dtype])


# --- compiling for a GPU without one -----------------------------------------------------------


def test_quantized_gemms_compile_for_h100_without_spills(monkeypatch, tmp_path):
    # Llama-3-8B's 4096 x 4096 projection at decode (1 row), mid (64) and prefill (2048) tiles;
    # DeepSeek-V3's routed experts (hidden 7168, width 2048, blocks of 128), 8 of its 256 here,
    # at token counts that give each of the fused MoE's tile tiers.
    if INTERPRETED:
        pytest.skip("checked in the parent process")
    pytest.importorskip("triton.backends.nvidia")
    from pdserve.kernels import triton_fp8_block, triton_moe_fp8, triton_w4a16

    launches = []

    def recorder(kernel):
        def record(*args, grid, warmup, **kwargs) -> None:
            launches.append((kernel, args, kwargs))

        return record

    for module in (triton_w4a16, triton_fp8_block, triton_moe_fp8):
        for name in dir(module):
            if name.endswith("_kernel"):
                kernel = getattr(module, name)
                monkeypatch.setattr(kernel, "run", recorder(kernel))
    dtype, n, k = torch.bfloat16, 4096, 4096
    qweight = torch.zeros(n, k // 8, dtype=torch.int32)
    scales, zeros = (
        torch.ones(n, k // 128, dtype=dtype),
        torch.zeros(n, k // 128, dtype=torch.uint8),
    )
    weight, scale_inv = torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(32, 32)
    for m in (1, 64, 2048):
        x = torch.zeros(m, k, dtype=dtype)
        triton_w4a16.w4a16_matmul(x, qweight, scales, zeros, 128)
        triton_fp8_block.fp8_block_matmul(x, weight, scale_inv, (128, 128))
        triton_fp8_block.w8a16_block_matmul(x, weight, scale_inv, (128, 128))
    triton_w4a16.w4a16_matmul(x, qweight, scales, None, 128)  # symmetric, at prefill
    hidden, inter, experts = 7168, 2048, 8
    w13 = torch.zeros(experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(experts, hidden, inter, dtype=torch.float8_e4m3fn)
    w13_scale, w2_scale = torch.ones(experts, 32, 56), torch.ones(experts, 56, 16)
    for tokens in (4, 64, 128):
        ids, weights = torch.arange(8).repeat(tokens, 1), torch.ones(tokens, 8) / 8
        x = torch.zeros(tokens, hidden, dtype=dtype)
        triton_moe_fp8.fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, weights, ids, (128, 128))
    assert len(launches) == 3 * 3 + 1 + 3 * 2
    for kernel, args, kwargs in launches:
        ptx = _compile_for_sm90(kernel, args, kwargs, tmp_path).asm["ptx"]
        fp8_mma = re.findall(r"\S*mma\S*e4m3", ptx)
        if kwargs.get("FP8_DOT") and kwargs["BLOCK_M"] >= 64:  # prefill: Hopper's FP8 wgmma
            assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in fp8_mma
        if kwargs.get("FP8_DOT") is False:  # the fallback, for GPUs without FP8: an A100
            assert not fp8_mma
            _compile_for_sm90(kernel, args, kwargs, tmp_path, capability=80)


# --- on CUDA ------------------------------------------------------------------------------------


def _close_on_gpu(out: torch.Tensor, expected: torch.Tensor, fraction: float) -> None:
    """Within `fraction` of the largest expected magnitude (bfloat16 rounds at 2**-9)."""
    error = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= fraction, f"{error:.2e} of the largest output"


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 33, 300])
def test_quantized_gemms_on_cuda_equal_their_references(m):
    # bfloat16 on the GPU's tensor cores, N and K ending mid block (1000 x 1040, blocks of 128).
    from pdserve.engine.quant.fp8_linear import Fp8Linear
    from pdserve.engine.quant.gemm_choice import Fp8Gemm, fp8_gemm_on
    from pdserve.kernels.triton_fp8_block import fp8_block_matmul, w8a16_block_matmul
    from pdserve.kernels.triton_moe_fp8 import fused_moe_fp8
    from pdserve.kernels.triton_w4a16 import w4a16_matmul

    cuda, dtype, n, k, block = torch.device("cuda"), torch.bfloat16, 1000, 1040, (128, 128)
    x, qweight, scales, zeros = (t.cuda() for t in w4a16_inputs(m, n, k, 128, True, dtype))
    expected = w4a16_matmul_ref(x, qweight, scales, zeros, 128)
    _close_on_gpu(w4a16_matmul(x, qweight, scales, zeros, 128), expected, 1e-2)
    x, weight, scale_inv = (t.cuda() for t in fp8_inputs(m, n, k, block, dtype))
    exact = fp8_block_matmul_ref(x, weight, scale_inv, block, quantize_x=False)
    _close_on_gpu(w8a16_block_matmul(x, weight, scale_inv, block), exact, 1e-2)
    gemm = fp8_gemm_on(cuda)
    if gemm is Fp8Gemm.FP8:
        expected = fp8_block_matmul_ref(x, weight, scale_inv, block)
        _close_on_gpu(fp8_block_matmul(x, weight, scale_inv, block), expected, 1e-2)
    else:
        expected = exact
    layer = Fp8Linear(k, (n,), bias=False, block=block).to(cuda)
    layer.weight.data.copy_(weight)
    layer.weight_scale_inv.data.copy_(scale_inv)
    _close_on_gpu(layer(x), expected, 1e-2)  # the kernel its device chose
    (w13, w13_scale, w2, w2_scale), (w13_f, w2_f) = fp8_experts(8, 256, 384, block)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(m, 256, generator=gen).to(dtype).cuda()
    weights, ids = torch.topk(torch.randn(m, 8, generator=gen).softmax(-1), 2)
    weights, ids = weights.cuda(), ids.cuda()
    experts = [t.cuda() for t in (w13, w13_scale, w2, w2_scale)]
    expected = moe_ref.fused_moe(
        hidden, w13_f.to(dtype).cuda(), w2_f.to(dtype).cuda(), weights, ids
    )
    _close_on_gpu(fused_moe_fp8(hidden, *experts, weights, ids, block), expected, 3e-2)
