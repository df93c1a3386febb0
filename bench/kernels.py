"""Attention kernels against the device's own limits, measured side by side in one run: paged
decode attention's KV bandwidth as a fraction of a device-to-device copy, and prefill attention's
TFLOP/s as a fraction of a bf16 matmul; the torch reference is timed on the same inputs.

    .venv/bin/python -m pdserve.bench.kernels                    # Llama-3-8B attention shapes, bf16
    .venv/bin/python -m pdserve.bench.kernels --batches 1,16 --contexts 4096 --json out.json
    .venv/bin/python -m pdserve.bench.kernels --quick            # gpu-check's shorter sweep

Prefill runs at 2k, 4k and 8k tokens through the op table (on sm_90 and later the Hopper kernel,
`kernels.triton_prefill_hopper`, whose rows also time the portable kernel on the same inputs).
Then the other token mixers (bench/kernels_mixers.py; `--no-mixers` skips them): sliding-window
decode and the Gated DeltaNet step and chunked prefill.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pdserve.bench.device_limits import DeviceLimits, Results
from pdserve.bench.kernel_inputs import (  # noqa: F401  (paged_inputs: bench.cpu_attention's too)
    BLOCK_SIZE,
    DTYPE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    paged_inputs,
)
from pdserve.bench.kernels_mixers import (
    MixerRow,
    bench_delta_prefill,
    bench_delta_step,
    bench_window_decode,
)

# The sweeps: the full one for the docs, the quick one for `make gpu-check`'s time box.
# Prefill at 2k, 4k and 8k tokens: the range of the prefill attention aim.
FULL_SWEEP = {
    "batches": [1, 16, 64, 256],
    "contexts": [512, 4096],
    "prefill_prompts": [1, 4],
    "prompt_lens": [2048, 4096, 8192],
}
QUICK_SWEEP = {
    "batches": [1, 64, 256],
    "contexts": [4096],
    "prefill_prompts": [1],
    "prompt_lens": [2048, 4096, 8192],
}
# The torch reference materializes every score in float32: timed only up to this many.
REFERENCE_MAX_SCORES = 4 * 2048 * 2048
# Decode inputs rotated through in graph timing: several times an H100's 50 MB L2.
ROTATE_BYTES = 256 << 20


@dataclass(slots=True)
class AttentionDecode:
    """Paged decode attention, one query per sequence, against the copy."""

    batch: int
    context: int
    triton_graph_us: float  # per step, launched from a CUDA graph (as the decode loop runs it)
    triton_eager_us: float  # per step, launched from Python
    reference_us: float | None
    kv_gb: float
    triton_gbps: float
    fraction_of_copy: float


@dataclass(slots=True)
class AttentionPrefill:
    """Causal prefill attention against the matmul."""

    prompts: int
    prompt_len: int
    triton_ms: float
    reference_ms: float | None
    tflop: float
    triton_tflops: float
    fraction_of_matmul: float
    # The prefill kernel the op table chose on this GPU (`hopper` on sm_90 and later), and the
    # portable kernel's time on the same inputs beside it.
    kernel: str = "portable"
    portable_ms: float | None = None


def _time_ms(fn: Callable[[], object]) -> float:
    """Median time of fn in ms, L2 flushed between runs (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_time_ms(fns: list[Callable[[], object]], replays: int = 20) -> float:
    """Time per call of fns captured back to back in one CUDA graph (no launch overhead)."""
    for fn in fns:
        fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * len(fns))


def measure_limits() -> DeviceLimits:
    """The GPU's copy (2 GiB) and bf16 matmul (8192 square), timed as the kernels are."""
    return DeviceLimits.measure(_time_ms, "cuda", DTYPE, 2 << 30, 8192)


def bench_decode(
    batch: int, context: int, limits: DeviceLimits, with_reference: bool
) -> AttentionDecode:
    from pdserve.kernels import attention_ref
    from pdserve.kernels.triton_ops import TRITON

    inputs = paged_inputs([context] * batch, [1] * batch)
    kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * inputs["k_cache"].element_size()
    # Graph replays rotate through enough separate caches that they cannot live in L2.
    sets = [inputs] + [
        paged_inputs([context] * batch, [1] * batch, seed)
        for seed in range(1, min(64, -(-ROTATE_BYTES // kv_bytes)))
    ]
    graph_ms = graph_time_ms([lambda s=s: TRITON.paged_attention(**s) for s in sets])
    del sets[1:]
    eager_ms = _time_ms(lambda: TRITON.paged_attention(**inputs))
    reference_ms = (
        _time_ms(lambda: attention_ref.paged_attention(**inputs)) if with_reference else None
    )
    gbps = kv_bytes / (graph_ms * 1e-3) / 1e9
    return AttentionDecode(
        batch=batch,
        context=context,
        triton_graph_us=graph_ms * 1e3,
        triton_eager_us=eager_ms * 1e3,
        reference_us=None if reference_ms is None else reference_ms * 1e3,
        kv_gb=kv_bytes / 1e9,
        triton_gbps=gbps,
        fraction_of_copy=limits.of_copy(gbps),
    )


def bench_prefill(
    prompts: int, prompt_len: int, limits: DeviceLimits, with_reference: bool
) -> AttentionPrefill:
    from pdserve.kernels import attention_ref, triton_attention, triton_prefill_hopper
    from pdserve.kernels.triton_ops import TRITON

    inputs = paged_inputs([prompt_len] * prompts, [prompt_len] * prompts)
    triton_ms = _time_ms(lambda: TRITON.paged_attention(**inputs))
    hopper = triton_prefill_hopper.hopper_prefill_applies(
        torch.cuda.get_device_capability(),
        triton_prefill_hopper.descriptors_supported(),
        DTYPE,
        HEAD_DIM,
        NUM_HEADS // NUM_KV_HEADS,
        BLOCK_SIZE,
    )
    portable_ms = _time_ms(lambda: triton_attention.paged_attention(**inputs)) if hopper else None
    with_reference = with_reference and prompts * prompt_len**2 <= REFERENCE_MAX_SCORES
    reference_ms = (
        _time_ms(lambda: attention_ref.paged_attention(**inputs)) if with_reference else None
    )
    # Causal: query i attends to i + 1 keys; QK^T and PV are 2 flops per multiply-add each.
    attended = prompt_len * (prompt_len + 1) // 2
    flop = prompts * 4 * NUM_HEADS * HEAD_DIM * attended
    tflops = flop / (triton_ms * 1e-3) / 1e12
    return AttentionPrefill(
        prompts=prompts,
        prompt_len=prompt_len,
        triton_ms=triton_ms,
        reference_ms=reference_ms,
        tflop=flop / 1e12,
        triton_tflops=tflops,
        fraction_of_matmul=limits.of_matmul(tflops),
        kernel="hopper" if hopper else "portable",
        portable_ms=portable_ms,
    )


def bench_mixers(limits: DeviceLimits) -> list[MixerRow]:
    """Sliding-window decode and the Gated DeltaNet step and prefill (bench/kernels_mixers.py),
    printed as one table: each against its reference, as a share of copy or of the matmul."""
    print("\n## other token mixers (window attention, Gated DeltaNet)\n")
    print("| mixer | case | ms | torch ref ms | GB | TFLOP | of limit | max abs error |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for bench in (bench_window_decode, bench_delta_step, bench_delta_prefill):
        r = bench(limits, _time_ms)
        torch.cuda.empty_cache()
        rows.append(r)
        ref = "-" if r.reference_ms is None else f"{r.reference_ms:.3f}"
        limit = "copy" if r.gb else "matmul"
        print(
            f"| {r.mixer} | {r.case} | {r.ms:.3f} | {ref} | {r.gb:.3f} | {r.tflop:.3f} | "
            f"{r.fraction:.0%} of {limit} | {r.max_abs_error:.2e} |",
            flush=True,
        )
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=_ints, default=None, help="default 1,16,64,256")
    parser.add_argument("--contexts", type=_ints, default=None, help="default 512,4096")
    parser.add_argument("--prefill-prompts", type=_ints, default=None, help="default 1,4")
    parser.add_argument(
        "--prompt-lens",
        type=_ints,
        default=None,
        help="prefill prompt lengths, default 2048,4096,8192",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch ref")
    parser.add_argument(
        "--no-mixers",
        action="store_true",
        help="skip sliding-window decode and the Gated DeltaNet step and prefill",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="batches 1,64,256 at 4096 tokens; 1 prompt of 2k, 4k and 8k tokens",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    # Flags given win over either sweep.
    sweep = QUICK_SWEEP if args.quick else FULL_SWEEP
    for name, values in sweep.items():
        if getattr(args, name) is None:
            setattr(args, name, values)
    if not torch.cuda.is_available():
        print(
            "pdserve.bench.kernels: CUDA is not available; the Triton kernels need an NVIDIA GPU."
        )
        return 0
    import triton

    with_reference = not args.no_reference
    device = torch.cuda.get_device_name()
    limits = measure_limits()
    print(
        f"# {device}; torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}"
    )
    print(
        f"# device-to-device copy: {limits.copy_gbps:.0f} GB/s (read + write); "
        f"bf16 matmul: {limits.matmul_tflops:.0f} TFLOP/s"
    )
    print(
        f"# attention: {NUM_HEADS} q heads, {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
        f"{str(DTYPE)[6:]}, block {BLOCK_SIZE}"
    )
    print("\n## decode (one query per sequence)\n")
    print(
        "| batch | context | triton µs (graph) | triton µs (eager) | torch ref µs "
        "| KV read GB | GB/s (graph) | of copy BW |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    decode = []
    for context in args.contexts:
        for batch in args.batches:
            r = bench_decode(batch, context, limits, with_reference)
            torch.cuda.empty_cache()
            decode.append(r)
            ref = "-" if r.reference_us is None else f"{r.reference_us:.1f}"
            print(
                f"| {batch} | {context} | {r.triton_graph_us:.1f} | {r.triton_eager_us:.1f} | "
                f"{ref} | {r.kv_gb:.3f} | "
                f"{r.triton_gbps:.0f} | {r.fraction_of_copy:.0%} |",
                flush=True,
            )
    print("\n## prefill (causal)\n")
    print(
        "| prompts | tokens | kernel | triton ms | portable ms | torch ref ms | TFLOP | TFLOP/s "
        "| of matmul |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    prefill = []
    for prompt_len in args.prompt_lens:
        for prompts in args.prefill_prompts:
            r = bench_prefill(prompts, prompt_len, limits, with_reference)
            torch.cuda.empty_cache()
            prefill.append(r)
            ref = "-" if r.reference_ms is None else f"{r.reference_ms:.2f}"
            portable = "-" if r.portable_ms is None else f"{r.portable_ms:.2f}"
            print(
                f"| {prompts} | {prompt_len} | {r.kernel} | {r.triton_ms:.2f} | {portable} | "
                f"{ref} | {r.tflop:.2f} | {r.triton_tflops:.0f} | {r.fraction_of_matmul:.0%} |",
                flush=True,
            )
    mixers = []
    if not args.no_mixers:
        mixers = bench_mixers(limits)
    if args.json:
        command = " ".join(["python -m pdserve.bench.kernels", *(argv or sys.argv[1:])])
        results = Results(device, command, limits, decode, prefill).to_dict()
        results["mixers"] = [asdict(r) for r in mixers]
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
