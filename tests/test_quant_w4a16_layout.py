"""AWQ's and GPTQ's 4-bit layers rewritten into the layout Triton's W4A16 GEMM reads (what they
hold on a GPU once loaded): the operands they hand the kernel multiply like the published
weight, checked through the kernel's torch reference (`w4a16_ref.w4a16_matmul_ref`) on the CPU,
and through the kernel itself under Triton's interpreter for one AWQ and one act-order GPTQ
layer. The converted layer holds its weight once, and dequantizes to the very same weight."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import build_checkpoint
from conftest import random_prompts
from test_triton_kernels import INTERPRETED, interpreted, run_interpreted

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.loader import load_model
from pdserve.engine.quant import awq_reference, gptq_reference, w4a16_layout
from pdserve.engine.quant.awq_linear import AwqLinear
from pdserve.engine.quant.gemm_choice import w4a16_gemm_on
from pdserve.engine.quant.gptq_linear import GptqLinear
from pdserve.engine.quant.packed_checkpoint import write_awq_checkpoint, write_gptq_checkpoint
from pdserve.engine.quant.packed_linear import PackedLinear
from pdserve.kernels.w4a16_ref import w4a16_matmul_ref

IN = 64
PARTS = (16, 8, 8)  # a fused q/k/v: each part quantized (and act-ordered) on its own


def awq_layer(parts: tuple[int, ...], group: int, seed: int = 0) -> AwqLinear:
    gen = torch.Generator().manual_seed(seed)
    layer = AwqLinear(IN, parts, False, group)
    packed = [awq_reference.quantize(torch.randn(rows, IN, generator=gen), group) for rows in parts]
    for kind, i in (("qweight", 0), ("qzeros", 1), ("scales", 2)):
        getattr(layer, kind).data = torch.cat([p[i] for p in packed], dim=1)
    return layer


def gptq_layer(
    parts: tuple[int, ...],
    group: int,
    sym: bool,
    v1: bool,
    act_order: str | None = None,
    bits: int = 4,
) -> GptqLinear:
    """act_order: None (inputs in order), "own" (each part its own shuffled g_idx, as a fused
    layer of act-order projections holds) or "shared" (one shuffled g_idx for all parts)."""
    layer = GptqLinear(IN, parts, False, bits, group, act_order is not None, v1)
    packed = []
    for i, rows in enumerate(parts):
        weight = torch.randn(rows, IN, generator=torch.Generator().manual_seed(i))
        seed = {None: None, "own": 10 + i, "shared": 10}[act_order]
        g_idx = gptq_reference.act_order_groups(IN, group, seed)
        packed.append(gptq_reference.quantize(weight, g_idx, bits, sym, v1))
        layer.g_idx.data[i] = g_idx
    for kind, i in (("qweight", 0), ("qzeros", 1), ("scales", 2)):
        getattr(layer, kind).data = torch.cat([p[i] for p in packed], dim=1)
    return layer


LAYERS = {
    "awq": lambda: awq_layer((16,), 16),
    "awq_fused_groups_of_32": lambda: awq_layer(PARTS, 32),
    "gptq_sym_v1": lambda: gptq_layer(PARTS, 16, sym=True, v1=True),
    "gptq_asym_v1": lambda: gptq_layer(PARTS, 16, sym=False, v1=True),
    "gptq_asym_v2": lambda: gptq_layer(PARTS, 32, sym=False, v1=False),
    "gptq_one_group": lambda: gptq_layer(PARTS, -1, sym=False, v1=True),
    "gptq_act_order": lambda: gptq_layer(PARTS, 16, sym=False, v1=True, act_order="own"),
    "gptq_act_order_v2_sym": lambda: gptq_layer((16,), 16, sym=True, v1=False, act_order="own"),
    "gptq_act_order_shared": lambda: gptq_layer(PARTS, 16, sym=False, v1=True, act_order="shared"),
}


def param_bytes(layer: PackedLinear) -> dict[str, int]:
    return {name: p.numel() * p.element_size() for name, p in layer.named_parameters()}


@pytest.mark.parametrize("name", LAYERS)
def test_the_kernels_operands_multiply_as_the_published_weight(name, monkeypatch):
    # Convert 8 outputs at a time, so a part of 16 is converted in two chunks.
    monkeypatch.setattr(w4a16_layout, "CHUNK", 8)
    layer = LAYERS[name]()
    published = layer.dequantized(torch.float32)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(7))
    expected = x @ published.T
    before = param_bytes(layer)
    assert layer.to_kernel_layout() and layer.in_kernel_layout
    # The published tensors are replaced, not kept beside the kernel's: the 4-bit words take
    # the same bytes, the rest (scales, unpacked zero points, act-order's input order) is small.
    after = param_bytes(layer)
    assert not {"qweight", "qzeros", "scales", "g_idx"} & set(after)
    assert after["kernel_qweight"] == before["qweight"]
    assert sum(after.values()) <= sum(before.values()) + layer.out_features * 4
    assert ("kernel_perm" in after) == name.startswith("gptq_act_order")
    assert torch.equal(layer.dequantized(torch.float32), published)
    torch.testing.assert_close(layer.kernel_matmul(x, w4a16_matmul_ref), expected)


def test_act_order_sorts_each_parts_inputs_by_group_and_permutes_x_per_part():
    layer = LAYERS["gptq_act_order"]()
    g_idx = layer.g_idx.clone()
    layer.to_kernel_layout()
    perm = layer.kernel_perm
    assert perm.shape == (3, IN)  # each fused part in its own order
    for i in range(3):
        assert torch.equal(g_idx[i][perm[i].long()], torch.arange(IN, dtype=torch.int32) // 16)
    shared = LAYERS["gptq_act_order_shared"]()
    shared.to_kernel_layout()
    assert shared.kernel_perm.shape == (1, IN)  # one order: x permuted once, one kernel call


def test_layers_the_kernel_cannot_read_keep_the_published_layout():
    eight_bit = gptq_layer(PARTS, 32, sym=False, v1=False, bits=8)
    assert not eight_bit.to_kernel_layout() and not eight_bit.in_kernel_layout
    assert "bits 8" in eight_bit.kernel_unfit
    groups_of_24 = gptq_layer(PARTS, 24, sym=False, v1=True)  # 64 inputs, a ragged last group
    assert not groups_of_24.to_kernel_layout() and "multiple of 16" in groups_of_24.kernel_unfit
    # Groups of unequal sizes: no order of the inputs makes them runs of the group size.
    uneven = gptq_layer((16,), 16, sym=False, v1=True, act_order="own")
    uneven.g_idx.data[0] = torch.tensor([0] * 8 + [1] * 24 + [2] * 16 + [3] * 16, dtype=torch.int32)
    expected = uneven.dequantized(torch.float32)
    assert not uneven.to_kernel_layout() and "runs" in uneven.kernel_unfit
    assert torch.equal(uneven.dequantized(torch.float32), expected)


def test_a_row_parallel_share_of_act_order_inputs_keeps_the_published_layout():
    """A rank of o_proj or down_proj with act-order holds every group's scales (its inputs may
    fall in any): the kernel's groups k // G would not index them. `size` is all the layer reads
    of its tensor-parallel group when built."""
    layer = GptqLinear(32, (16,), False, 4, 16, True, True, group=SimpleNamespace(size=2))
    assert layer.num_groups == 4  # the whole projection's 64 inputs
    layer.g_idx.data[0] = torch.arange(32, dtype=torch.int32) // 16  # even in order
    assert not layer.to_kernel_layout() and "every group" in layer.kernel_unfit


def test_a_converted_layer_keeps_its_dtypes_through_moves_and_refuses_to_load():
    layer = LAYERS["gptq_act_order"]()
    layer.to_kernel_layout()
    layer.to(torch.bfloat16)
    dtypes = {name: p.dtype for name, p in layer.named_parameters()}
    assert dtypes == {
        "kernel_qweight": torch.int32,
        "kernel_scales": torch.float16,
        "kernel_zeros": torch.uint8,
        "kernel_perm": torch.int32,
    }
    with pytest.raises(RuntimeError, match="converted to the W4A16 kernel's layout"):
        layer.load("scales", None, 0, range(16), 16, 0)


FORMATS = ["awq", "gptq_act_order"]


@pytest.fixture(scope="module")
def packed_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen3 written by our writers of the published layouts: AWQ in groups of 16, and
    GPTQ asymmetric act-order in groups of 16 (each projection in an order of its own)."""
    root = tmp_path_factory.mktemp("w4a16_layout")
    plain = build_checkpoint("qwen3", root / "plain")
    return {
        "awq": write_awq_checkpoint(plain, root / "awq", group_size=16),
        "gptq_act_order": write_gptq_checkpoint(
            plain, root / "gptq", group_size=16, desc_act=True, sym=False
        ),
    }


@pytest.mark.parametrize("format", FORMATS)
def test_every_layer_of_a_loaded_checkpoint_converts_to_the_same_weight(format, packed_checkpoints):
    """Through the loader: fused q/k/v and gate/up of projections each act-ordered on its own,
    o_proj and down_proj. On the CPU nothing converts at load (`loaded` converts only where the
    kernel runs); converted here by hand."""
    packed = packed_checkpoints[format]
    model = load_model(packed, "float32", "cpu")
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 8 and not any(m.in_kernel_layout for m in layers)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    for layer in layers:
        published = layer.dequantized(torch.float32)
        assert layer.to_kernel_layout()
        assert torch.equal(layer.dequantized(torch.float32), published)
        rows = x[:, : layer.in_features]
        torch.testing.assert_close(layer.kernel_matmul(rows, w4a16_matmul_ref), rows @ published.T)
    if format == "gptq_act_order":  # q, k and v each in its own order
        qkv = model.layers[0].self_attn.qkv_proj
        assert len(qkv.out_parts) == 3 and qkv.kernel_perm.shape == (3, qkv.in_features)


# --- the kernel itself, under Triton's interpreter -----------------------------------------------


@pytest.mark.slow
def test_the_triton_kernel_runs_the_converted_layers_under_the_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the child process")
    run_interpreted(__file__)


@interpreted
@pytest.mark.parametrize("name", ["awq_fused_groups_of_32", "gptq_act_order"])
def test_triton_w4a16_matches_the_published_weight(name):
    from pdserve.kernels.triton_w4a16 import w4a16_matmul

    layer = LAYERS[name]()
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(7))
    expected = x @ layer.dequantized(torch.float32).T
    layer.to_kernel_layout()
    # float32 both sides, the same products summed in another order.
    torch.testing.assert_close(layer.kernel_matmul(x, w4a16_matmul), expected, atol=1e-5, rtol=1e-5)


# --- on a GPU (`make gpu-check` runs what skips without CUDA) -------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# As test_triton_quant's W4A16 tolerances: float32 differs in summation order only; bfloat16
# rounds each dequantized weight and the output (two units in the last place).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2)}


def _needs_the_kernel() -> None:
    if not w4a16_gemm_on(torch.device("cuda")):
        pytest.skip("the W4A16 kernel needs Triton and bf16 tensor cores (compute capability 8.0)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("format", FORMATS)
def test_on_cuda_layers_convert_at_load_and_multiply_as_the_cpu_weight(
    format, dtype, packed_checkpoints
):
    _needs_the_kernel()
    cpu = load_model(packed_checkpoints[format], "float32", "cpu")
    gpu = load_model(packed_checkpoints[format], str(dtype).removeprefix("torch."), "cuda")
    published = {n: m for n, m in cpu.named_modules() if isinstance(m, PackedLinear)}
    converted = {n: m for n, m in gpu.named_modules() if isinstance(m, PackedLinear)}
    assert converted.keys() == published.keys() and len(converted) == 8
    gen = torch.Generator().manual_seed(0)
    for name, layer in converted.items():
        assert layer.in_kernel_layout and "qweight" not in dict(layer.named_parameters())
        x = torch.randn(5, layer.in_features, generator=gen).to(dtype)
        expected = x.float() @ published[name].dequantized(torch.float32).T
        got = layer(x.to("cuda", dtype)).float().cpu()
        torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("format", FORMATS)
def test_on_cuda_greedy_tokens_equal_the_cpus_in_float32(format, packed_checkpoints):
    """The engine on CUDA (the W4A16 kernel, CUDA graphs for decode) against the CPU's torch
    dequantization, token for token."""
    _needs_the_kernel()
    prompts = random_prompts(0, [3, 17, 30])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cuda"):
        model = str(packed_checkpoints[format])
        with LLM(model, num_kv_blocks=64, device=device, dtype="float32") as llm:
            tokens[device] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens["cuda"] == tokens["cpu"]
