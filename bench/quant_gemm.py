"""The Triton GEMMs for quantized weights against cuBLAS in bfloat16 (`torch.matmul`), in one run
on one GPU: W4A16 (groups of 128, zero points), block-scaled FP8 (FP8 dots where the GPU has them,
and the W8A16 variant) and FP8 experts in the fused MoE, at decode (1 and 8 rows) and prefill
(2048 rows) sizes, each also checked against its torch reference.

    python -m pdserve.bench.quant_gemm --json quant_gemm.json   # CUDA only

Weights are [N, K] = 4096 x 4096 (Llama-3-8B's o_proj) and 4096 x 14336 (its down_proj); the MoE
layer is 32 of DeepSeek-V3's routed experts (hidden 7168, width 2048, top-8, blocks of 128)
against the same experts in bfloat16 through the bf16 fused MoE. Times are CUDA-graph replays (no
launch overhead), as decode steps run them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pdserve.bench.kernels import graph_time_ms
from pdserve.engine.quant.gemm_choice import Fp8Gemm, fp8_gemm
from pdserve.kernels import moe_ref
from pdserve.kernels.fp8_block_ref import dequantize_blocks, fp8_block_matmul_ref
from pdserve.kernels.w4a16_ref import pack_int4, w4a16_matmul_ref
from pdserve.tune import provenance

WEIGHTS = ((4096, 4096), (4096, 14336))  # [N, K]
ROWS = (1, 8, 2048)
GROUP = 128  # W4A16 group size
BLOCK = (128, 128)  # FP8 weight blocks
MOE = dict(hidden=7168, width=2048, experts=32, top_k=8)
# Equal to the reference: the largest difference at most this fraction of the largest output.
# The GEMMs round their output to bfloat16 (2**-9), W4A16 also its weights before the dot; the
# MoE rounds both projections, silu, their product and each expert's output, and its reference
# the dequantized weights too.
TOLERANCE = {"gemm": 1e-2, "moe": 3e-2}


def _error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference as a fraction of the largest expected magnitude."""
    return float((out.float() - expected.float()).abs().max() / expected.float().abs().max())


def _row(kernel: str, shape: list[int], rows: int, us: float, bf16_us: float, nbytes: float,
         flop: float, error: float, tolerance: float = TOLERANCE["gemm"]) -> dict:  # fmt: skip
    """One measured case: `nbytes` the weight bytes it reads, `flop` its multiply-adds x 2."""
    return {
        "kernel": kernel,
        "weight": shape,
        "rows": rows,
        "us": us,
        "bf16_us": bf16_us,
        "speedup": bf16_us / us,
        "weight_gbps": nbytes / (us * 1e-6) / 1e9,
        "tflops": flop / (us * 1e-6) / 1e12,
        "max_error": error,
        "tolerance": tolerance,
        "equal": error <= tolerance,
    }


def time_us(fn: Callable[[], object], replays: int) -> float:
    return graph_time_ms([fn] * 4, replays) * 1e3


def dense_rows(device: str, replays: int, rows_list: tuple[int, ...]) -> list[dict]:
    from pdserve.kernels.triton_fp8_block import fp8_block_matmul, w8a16_block_matmul
    from pdserve.kernels.triton_w4a16 import w4a16_matmul

    capability = torch.cuda.get_device_capability(device)
    fp8_dots = fp8_gemm("cuda", capability, True) is Fp8Gemm.FP8
    out = []
    for n, k in WEIGHTS:
        gen = torch.Generator(device).manual_seed(0)
        weight = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * k**-0.5
        q = torch.randint(0, 16, (n, k), device=device, generator=gen)
        qweight = pack_int4(q)
        scales = (torch.rand(n, k // GROUP, device=device, generator=gen) * 0.01).bfloat16()
        zeros = torch.randint(0, 16, (n, k // GROUP), device=device, generator=gen).to(torch.uint8)
        fp8 = (torch.randn(n, k, device=device, generator=gen) * 100).clamp(-448, 448)
        fp8 = fp8.to(torch.float8_e4m3fn)
        scale_inv = torch.rand(n // BLOCK[0], k // BLOCK[1], device=device, generator=gen) * 1e-3
        for m in rows_list:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            bf16_us = time_us(partial(torch.matmul, x, weight.T), replays)
            w4_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
            fp8_bytes = fp8.numel() + scale_inv.numel() * 4
            cases = [
                (
                    "w4a16",
                    partial(w4a16_matmul, x, qweight, scales, zeros, GROUP),
                    partial(w4a16_matmul_ref, x, qweight, scales, zeros, GROUP),
                    w4_bytes,
                ),
                (
                    "w8a16_block",
                    partial(w8a16_block_matmul, x, fp8, scale_inv, BLOCK),
                    partial(fp8_block_matmul_ref, x, fp8, scale_inv, BLOCK, quantize_x=False),
                    fp8_bytes,
                ),
            ]
            if fp8_dots:
                fp8_case = (
                    "fp8_block",
                    partial(fp8_block_matmul, x, fp8, scale_inv, BLOCK),
                    partial(fp8_block_matmul_ref, x, fp8, scale_inv, BLOCK),
                    fp8_bytes,
                )
                cases.append(fp8_case)
            for name, kernel, reference, nbytes in cases:
                error = _error(kernel(), reference())
                us = time_us(kernel, replays)
                flop = 2.0 * m * n * k
                out.append(_row(name, [n, k], m, us, bf16_us, nbytes, flop, error))
    return out


def moe_rows(device: str, replays: int, rows_list: tuple[int, ...]) -> list[dict]:
    from pdserve.kernels.triton_moe import fused_moe
    from pdserve.kernels.triton_moe_fp8 import fused_moe_fp8

    h, i, e, top_k = MOE["hidden"], MOE["width"], MOE["experts"], MOE["top_k"]
    gen = torch.Generator(device).manual_seed(1)

    def experts(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(e, rows, cols, device=device, generator=gen) * 100).clamp(-448, 448)
        scales = torch.rand(e, rows // BLOCK[0], cols // BLOCK[1], device=device, generator=gen)
        return w.to(torch.float8_e4m3fn), scales * 1e-4

    w13, w13_scale = experts(2 * i, h)
    w2, w2_scale = experts(h, i)
    w13_bf16 = dequantize_blocks(w13, w13_scale, BLOCK).bfloat16()
    w2_bf16 = dequantize_blocks(w2, w2_scale, BLOCK).bfloat16()
    nbytes = w13.numel() + w2.numel()
    out = []
    for m in rows_list:
        x = torch.randn(m, h, device=device, generator=gen, dtype=torch.bfloat16)
        logits = torch.randn(m, e, device=device, generator=gen)
        weights, ids = torch.topk(logits.softmax(-1), top_k)

        def kernel(x=x, weights=weights, ids=ids) -> torch.Tensor:
            return fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, weights, ids, BLOCK)

        def bf16(x=x, weights=weights, ids=ids) -> torch.Tensor:
            return fused_moe(x, w13_bf16, w2_bf16, weights, ids)

        expected = moe_ref.fused_moe(x, w13_bf16, w2_bf16, weights, ids)
        error = _error(kernel(), expected)
        touched = int(torch.unique(ids).numel())  # experts whose weights the tokens read
        flop = 2.0 * m * top_k * 3 * h * i
        bf16_us = time_us(bf16, replays)
        row = _row("moe_fp8", [e, h, i], m, time_us(kernel, replays), bf16_us,
                   nbytes * touched / e, flop, error, TOLERANCE["moe"])  # fmt: skip
        out.append(row)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.quant_gemm", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default=None, help="comma-separated row counts (default 1,8,2048)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    record = provenance.start(sys.argv if argv is None else ["bench/quant_gemm.py", *argv])
    rows_list = tuple(int(r) for r in args.rows.split(",")) if args.rows else ROWS
    with torch.inference_mode():
        rows = dense_rows(args.device, args.replays, rows_list)
        rows += moe_rows(args.device, args.replays, rows_list)
    result = provenance.finish(record) | {
        "device": torch.cuda.get_device_name(args.device),
        "capability": list(torch.cuda.get_device_capability(args.device)),
        "rows": rows,
    }
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def render(result: dict) -> str:
    lines = [
        f"{result['device']}: quantized GEMMs against cuBLAS bf16; equal: the largest difference "
        "from the reference within its tolerance (a fraction of the largest output)",
        "",
        "| kernel | weight | rows | µs | µs bf16 | × bf16 | weight GB/s | TFLOP/s | equal |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['kernel']} | {'x'.join(map(str, r['weight']))} | {r['rows']} | "
            f"{r['us']:.1f} | {r['bf16_us']:.1f} | {r['speedup']:.2f} | {r['weight_gbps']:.0f} | "
            f"{r['tflops']:.1f} | {'yes' if r['equal'] else 'NO'} ({r['max_error']:.1e} of {r['tolerance']:.0e}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
