"""The torch references of the quantized GEMMs (`w4a16_ref`, `fp8_block_ref`) on hand-computed
values, and the choice of GEMM an FP8 layer makes from a device's capability: no GPU, no Triton.
The Triton kernels are checked against these references in `test_triton_quant`."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.quant.gemm_choice import Fp8Gemm, fp8_gemm, w4a16_gemm
from pdserve.kernels.fp8_block_ref import (
    dequantize_blocks,
    fp8_block_matmul_ref,
    quantize_activations,
)
from pdserve.kernels.w4a16_ref import dequantize, pack_int4, unpack_int4, w4a16_matmul_ref

# --- W4A16 --------------------------------------------------------------------------------------


def test_eight_nibbles_pack_into_one_word_lowest_bits_first():
    word = pack_int4(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]]))
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert word.item() == 0xF7654321 - 2**32  # as a signed int32
    # A ragged row: 10 values fill one word and two nibbles of the next, the rest zero.
    two = pack_int4(torch.tensor([[1] * 8 + [2, 3]]))
    assert two.tolist() == [[0x11111111, 0x32]]
    q = torch.randint(0, 16, (5, 21), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(q), 21), q.int())


def test_dequantize_subtracts_each_groups_zero_point_then_scales():
    q = pack_int4(torch.tensor([[0, 15, 8, 9]]))
    scales = torch.tensor([[0.5, 2.0]])
    # groups of 2: (0 - 1) * 0.5, (15 - 1) * 0.5, (8 - 8) * 2, (9 - 8) * 2
    assert dequantize(q, scales, torch.tensor([[1, 8]]), 2, 4).tolist() == [[-0.5, 7, 0, 2]]
    # symmetric: the zero point is 8
    assert dequantize(q, scales, None, 2, 4).tolist() == [[-4, 3.5, 0, 2]]
    x = torch.tensor([[1.0, 1.0, 1.0, 2.0]])
    assert w4a16_matmul_ref(x, q, scales, None, 2).tolist() == [[-4 + 3.5 + 0 + 4]]


# --- FP8 block-scaled ---------------------------------------------------------------------------


def test_fp8_blocks_dequantize_with_ragged_last_blocks():
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0], [-1.0, 0.5]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 10.0], [0.5, 1.0]])  # blocks of (2, 1): rows 0-1, then 2
    expected = [[2.0, 20.0], [6.0, 40.0], [-0.5, 0.5]]
    assert dequantize_blocks(weight, scale_inv, (2, 1)).tolist() == expected
    stacked = dequantize_blocks(torch.stack([weight] * 2), torch.stack([scale_inv] * 2), (2, 1))
    assert stacked.tolist() == [expected] * 2


def test_activations_quantize_per_token_and_group_to_448():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0, 0.0]])
    q, scales = quantize_activations(x, 2)
    # each group's largest magnitude maps to 448; an all-zero group keeps scale 1
    expected = torch.tensor([[2 / 448, 0.5 / 448, 1.0], [1.0, 3 / 448, 1.0]])
    torch.testing.assert_close(scales, expected)
    assert q.float().tolist() == [[224, -448, 448, 0, 0], [0, 0, 448, 0, 0]]
    # 1.1 in a group whose amax is 4.4 becomes 112 exactly; 1.05 rounds to e4m3's 104
    q, scales = quantize_activations(torch.tensor([[1.1, 4.4, 1.05, 4.4]]), 2)
    assert q.float().tolist() == [[112, 448, 104, 448]]


def test_fp8_reference_with_and_without_activation_quantization():
    weight = torch.tensor([[1.0, 1.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[0.5]])
    x = torch.tensor([[1.05, 4.4]])
    exact = fp8_block_matmul_ref(x, weight, scale_inv, (1, 2), quantize_x=False)
    assert exact.item() == pytest.approx((1.05 + 4.4) * 0.5)
    quantized = fp8_block_matmul_ref(x, weight, scale_inv, (1, 2))
    assert quantized.item() == pytest.approx((104 + 448) * 4.4 / 448 * 0.5)


# --- which GEMM an FP8 layer runs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "device, capability, triton, gemm",
    [
        ("cpu", None, True, Fp8Gemm.DEQUANTIZE),
        ("cuda", (9, 0), True, Fp8Gemm.FP8),  # H100, H200
        ("cuda", (8, 9), True, Fp8Gemm.FP8),  # L4, L40S, RTX 4090
        ("cuda", (10, 0), True, Fp8Gemm.FP8),  # B200
        ("cuda", (8, 6), True, Fp8Gemm.W8A16),  # A10, RTX 3090
        ("cuda", (8, 0), True, Fp8Gemm.W8A16),  # A100
        ("cuda", (7, 5), True, Fp8Gemm.DEQUANTIZE),  # T4: no bf16 tensor cores
        ("cuda", (9, 0), False, Fp8Gemm.DEQUANTIZE),  # no Triton installed
    ],
)
def test_an_fp8_layer_runs_fp8_dots_from_ada_on_w8a16_on_ampere_and_torch_elsewhere(
    device, capability, triton, gemm
):
    assert fp8_gemm(device, capability, triton) is gemm
    # A 4-bit layer runs its Triton kernel wherever the W8A16 fallback can run.
    assert w4a16_gemm(device, capability, triton) == (gemm is not Fp8Gemm.DEQUANTIZE)
