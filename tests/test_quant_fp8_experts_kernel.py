"""FP8 experts on a GPU run Triton's fused FP8 MoE (`kernels/triton_moe_fp8.py`) where bf16
experts run `triton_moe`'s: the choice (`gemm_choice.fp8_moe_kernel`) from the device's facts
alone, the model's CUDA-graph eligibility following it, and the stack's kernel branch itself run
on CPU tensors under Triton's interpreter (in a child process, as `test_triton_quant` runs its
kernels), equal to the same stack's torch path (each routed expert dequantized).

What the interpreter cannot show: the kernel's speed and a GPU's tensor-core numerics (`make
gpu-check` times `fused_moe_fp8` in its `quant_gemm` step on a lent GPU)."""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels import INTERPRETED, interpreted, run_interpreted

from pdserve.engine.quant import fp8_experts as fp8_experts_module
from pdserve.engine.quant.fp8_experts import Fp8Experts
from pdserve.engine.quant.fp8_reference import quantize
from pdserve.engine.quant.gemm_choice import fp8_moe_kernel, fp8_moe_kernel_on

parent_only = pytest.mark.skipif(INTERPRETED, reason="checked in the parent process")


# --- the choice ----------------------------------------------------------------------------------


@parent_only
@pytest.mark.parametrize(
    "device, capability, triton, block_k, kernel",
    [
        ("cuda", (9, 0), True, 128, True),  # H100/H200, DeepSeek-V3's blocks
        ("cuda", (8, 0), True, 128, True),  # A100: bf16 tensor cores suffice (weights decoded)
        ("cuda", (8, 9), True, 16, True),
        ("cuda", (7, 5), True, 128, False),  # T4: no bf16 tensor cores
        ("cuda", (9, 0), False, 128, False),  # no Triton
        ("cuda", None, True, 128, False),
        ("cpu", None, True, 128, False),
        ("cpu", (9, 0), True, 128, False),
        ("cuda", (9, 0), True, 96, False),  # a K block the kernel cannot step through whole
        ("cuda", (9, 0), True, 8, False),  # below tl.dot's 16
    ],
)
def test_fp8_experts_choose_the_fused_kernel_on_gpus_with_bf16_dots_and_triton(
    device, capability, triton, block_k, kernel
):
    assert fp8_moe_kernel(device, capability, triton, block_k) is kernel


@parent_only
def test_on_a_cpu_fp8_experts_keep_the_torch_path_and_run_eagerly():
    assert not fp8_moe_kernel_on(torch.device("cpu"), 128)
    experts = Fp8Experts(4, 96, 64, (64, 64))
    assert not experts.runs_kernel()
    assert "dequantized one routed expert at a time" in experts.eager_only


@parent_only
def test_a_model_whose_fp8_experts_run_the_kernel_may_be_captured_in_cuda_graphs(
    tmp_path, monkeypatch
):
    # Tiny Qwen3-MoE in FP8 (experts in blocks of 32), built on the CPU; the device's choice is
    # what eager_only follows, so it is set here as a GPU would set it.
    from checkpoints import build_checkpoint

    from pdserve.engine.models.loader import load_model
    from pdserve.engine.quant.fp8_checkpoint import write_fp8_checkpoint

    plain = build_checkpoint("qwen3_moe", tmp_path / "float32")
    fp8 = write_fp8_checkpoint(plain, tmp_path / "fp8", (32, 32))
    model = load_model(fp8, "float32", "cpu")
    assert any(isinstance(m, Fp8Experts) for m in model.modules())
    assert "dequantized one routed expert at a time" in model.eager_only
    monkeypatch.setattr(fp8_experts_module, "fp8_moe_kernel_on", lambda device, block_k: True)
    assert model.eager_only is None


# --- the kernel branch under the interpreter -----------------------------------------------------


@parent_only
@pytest.mark.slow
def test_kernel_branch_matches_the_torch_path_under_the_triton_interpreter():
    run_interpreted(__file__)


def filled_experts(
    num_experts: int, width: int, hidden: int, block: tuple[int, int], seed: int = 0
) -> Fp8Experts:
    """An FP8 stack as loading fills it from a checkpoint: each expert's gate, up and down
    quantized apart, so the gate's and the up projection's scale rows stay apart."""
    experts = Fp8Experts(num_experts, width, hidden, block)
    gen = torch.Generator().manual_seed(seed)
    gate_rows = -(-width // block[0])
    with torch.no_grad():
        for e in range(num_experts):
            for offset, scale_row in ((0, 0), (width, gate_rows)):  # gate, then up
                # Gate and up at different magnitudes, so their scales differ.
                weight = torch.randn(width, hidden, generator=gen) * (0.1 if offset else 0.4)
                q, s = quantize(weight, block)
                experts.w13[e, offset : offset + width] = q
                experts.w13_scale_inv[e, scale_row : scale_row + gate_rows] = s
            q, s = quantize(torch.randn(hidden, width, generator=gen) * 0.1, block)
            experts.w2[e], experts.w2_scale_inv[e] = q, s
    return experts


def choose_the_kernel(monkeypatch: pytest.MonkeyPatch) -> list:
    """Make the CPU choose the fused kernel, as a GPU does; returns the list of its calls."""
    from pdserve.kernels import triton_moe_fp8

    calls = []
    kernel = triton_moe_fp8.fused_moe_fp8

    def counted(*args, **kwargs) -> torch.Tensor:
        calls.append(args)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_moe_fp8, "fused_moe_fp8", counted)
    monkeypatch.setattr(fp8_experts_module, "fp8_moe_kernel_on", lambda device, block_k: True)
    return calls


# 4 experts of width 96 over a hidden size of 64, in blocks of 64: each expert's gate and up end
# in a ragged block (96 = 64 + 32), each with its own two scale rows, and the down projection's
# reduction ends mid block. float32: both paths multiply the same dequantized values, differing
# in summation order and where the block scale is applied (after the kernel's dot, before the
# reference's); bfloat16: the reference rounds the dequantized weights, the kernel scales after
# the dot (the tolerances of test_triton_quant's fused MoE).
KERNEL_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


@interpreted
@pytest.mark.parametrize("dtype, tokens", [(torch.float32, 5), (torch.bfloat16, 3)], ids=str)
def test_fp8_experts_kernel_branch_equals_their_torch_path(monkeypatch, dtype, tokens):
    experts = filled_experts(4, 96, 64, (64, 64))
    gate_scales, up_scales = experts.w13_scale_inv.split(2, dim=1)
    assert not torch.equal(gate_scales, up_scales)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(tokens, 4, generator=gen).softmax(-1), 2)
    expected = experts(x, weights, ids)  # the CPU's choice: each routed expert dequantized

    calls = choose_the_kernel(monkeypatch)
    assert experts.eager_only is None
    out = experts(x, weights, ids)
    assert len(calls) == 1  # the kernel branch ran
    assert out.dtype == dtype and out.shape == (tokens, 64)
    torch.testing.assert_close(out, expected, **KERNEL_TOL[dtype])


@interpreted
def test_a_sparse_layer_of_an_fp8_model_routes_its_tokens_through_the_kernel_branch(
    tmp_path, monkeypatch
):
    # The tiny Qwen3-MoE of test_quant_fp8_moe in blocks of 32 (its experts' width of 48 ends in
    # a ragged block): a sparse layer as the model runs it, routes from its own router, through
    # the kernel and through the torch path.
    from checkpoints import build_checkpoint

    from pdserve.engine.models.loader import load_model
    from pdserve.engine.models.moe import SparseMoE
    from pdserve.engine.quant.fp8_checkpoint import write_fp8_checkpoint
    from pdserve.kernels.ops import REFERENCE

    plain = build_checkpoint("qwen3_moe", tmp_path / "float32")
    model = load_model(write_fp8_checkpoint(plain, tmp_path / "fp8", (32, 32)), "float32", "cpu")
    layer = next(m for m in model.modules() if isinstance(m, SparseMoE))
    assert isinstance(layer.experts, Fp8Experts)
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    expected = layer(x, REFERENCE)
    calls = choose_the_kernel(monkeypatch)
    torch.testing.assert_close(layer(x, REFERENCE), expected, **KERNEL_TOL[torch.float32])
    assert len(calls) == 1


# --- on CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_fp8_experts_run_the_kernel_and_replay_in_a_cuda_graph_with_new_routes():
    # DeepSeek-V3's blocks, bfloat16 on the GPU's tensor cores: 8 experts of width 384 over a
    # hidden size of 256 (the width ends mid block), top-2 of 33 tokens.
    from pdserve.engine.quant.experts import QuantExperts

    experts = filled_experts(8, 384, 256, (128, 128)).to("cuda")
    assert experts.runs_kernel() and experts.eager_only is None
    gen = torch.Generator().manual_seed(2)

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(33, 256, generator=gen).to(torch.bfloat16)
        weights, ids = torch.topk(torch.randn(33, 8, generator=gen).softmax(-1), 2)
        return x.cuda(), weights.cuda(), ids.cuda()

    x, weights, ids = inputs()
    out = experts(x, weights, ids)
    expected = QuantExperts.forward(experts, x, weights, ids)  # each routed expert dequantized
    error = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= 3e-2, f"{error:.2e} of the largest output"
    # No host sync: the step captures, and a replay with new routes equals an eager call.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts(x, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts(x, weights, ids)
    for static, new in zip((x, weights, ids), inputs(), strict=True):
        static.copy_(new)
    graph.replay()
    assert torch.equal(captured, experts(x, weights, ids))
