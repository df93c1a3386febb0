"""Which GEMM a quantized layer runs on a device, decided from the device's facts alone (so it is
tested without a GPU). A block-scaled FP8 layer: Triton's FP8 tensor-core kernel where the GPU
has FP8 dots (capability 8.9 and up: Ada, Hopper, Blackwell), its W8A16 variant on older GPUs
with bf16 tensor cores, the per-call torch dequantization elsewhere (CPU, or no Triton). A 4-bit
layer: Triton's W4A16 kernel on GPUs with bf16 tensor cores, the torch dequantization elsewhere.
A layer's block-scaled FP8 experts: Triton's fused MoE on GPUs with bf16 tensor cores, each routed
expert dequantized in torch elsewhere."""

from __future__ import annotations

import enum
import functools
import importlib.util

import torch


class Fp8Gemm(enum.Enum):
    FP8 = "fp8"  # activations quantized per token and K block, FP8 dots
    W8A16 = "w8a16"  # weight decoded in-kernel, activations as they are
    DEQUANTIZE = "dequantize"  # the torch reference: dequantize per call, then F.linear


FP8_DOTS = (8, 9)  # the first capability with FP8 tensor cores (Ada)
BF16_DOTS = (8, 0)  # the first with bf16 tensor cores (Ampere)


def fp8_gemm(device_type: str, capability: tuple[int, int] | None, triton: bool) -> Fp8Gemm:
    """The GEMM for a device of `device_type` with CUDA `capability`, Triton installed or not."""
    if device_type != "cuda" or capability is None or not triton:
        return Fp8Gemm.DEQUANTIZE
    if capability >= FP8_DOTS:
        return Fp8Gemm.FP8
    if capability >= BF16_DOTS:
        return Fp8Gemm.W8A16
    return Fp8Gemm.DEQUANTIZE


@functools.cache
def fp8_gemm_on(device: torch.device) -> Fp8Gemm:
    """`fp8_gemm` for a tensor's device, looked up once per device."""
    if device.type != "cuda":
        return Fp8Gemm.DEQUANTIZE
    capability = torch.cuda.get_device_capability(device)
    return fp8_gemm(device.type, capability, importlib.util.find_spec("triton") is not None)


def w4a16_gemm(device_type: str, capability: tuple[int, int] | None, triton: bool) -> bool:
    """Whether a 4-bit layer on such a device runs `triton_w4a16.w4a16_matmul` (else the torch
    dequantization)."""
    return device_type == "cuda" and capability is not None and triton and capability >= BF16_DOTS


@functools.cache
def w4a16_gemm_on(device: torch.device) -> bool:
    """`w4a16_gemm` for a tensor's device, looked up once per device."""
    if device.type != "cuda":
        return False
    capability = torch.cuda.get_device_capability(device)
    return w4a16_gemm(device.type, capability, importlib.util.find_spec("triton") is not None)


def fp8_moe_kernel(
    device_type: str, capability: tuple[int, int] | None, triton: bool, block_k: int
) -> bool:
    """Whether FP8 experts with K blocks of `block_k` on such a device run
    `triton_moe_fp8.fused_moe_fp8` (else each routed expert is dequantized in torch): a GPU with
    bf16 tensor cores and Triton, as for the W8A16 GEMM (the kernel decodes the weights in
    registers and keeps the activations as they are), and a K block the kernel steps through
    whole (a power of two of at least 16; DeepSeek-V3's and Qwen3's 128)."""
    steps = block_k >= 16 and block_k & (block_k - 1) == 0
    on_gpu = device_type == "cuda" and capability is not None and triton
    return steps and on_gpu and capability >= BF16_DOTS


@functools.cache
def fp8_moe_kernel_on(device: torch.device, block_k: int) -> bool:
    """`fp8_moe_kernel` for a tensor's device, looked up once per device and block."""
    if device.type != "cuda":
        return False
    capability = torch.cuda.get_device_capability(device)
    return fp8_moe_kernel(
        device.type, capability, importlib.util.find_spec("triton") is not None, block_k
    )
