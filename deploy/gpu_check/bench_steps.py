"""Steps `kernels`, `model_step`, `moe`, `quant_gemm` and `kv_transfer`: the benchmarks of bench/ run as they run for
the docs (their tables go to the step's log, their JSON into the record), with the headline
figures the report compares with the aims.

    python -m pdserve.deploy.gpu_check.bench_steps kernels --json k.json [--long]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.deploy.gpu_check.record import StepRecord, step_args


def kernels(args, record: StepRecord, out: Path) -> str:  # noqa: ANN001
    from pdserve.bench import kernels as bench

    bench.main(["--json", str(out)] + ([] if args.long else ["--quick"]))
    data = json.loads(out.read_text())
    record.data = data
    record.figures = {"copy_gbps": data["copy_gbps"], "matmul_tflops": data["matmul_tflops"]}
    best = max(data["decode"], key=lambda r: r["fraction_of_copy"], default=None)
    prefill = max(data["prefill"], key=lambda r: r["fraction_of_matmul"], default=None)
    parts = [f"copy {data['copy_gbps']:.0f} GB/s, bf16 matmul {data['matmul_tflops']:.0f} TFLOP/s"]
    if best:
        parts.append(
            f"decode attention up to {best['fraction_of_copy']:.0%} of copy "
            f"(batch {best['batch']}, {best['context']} tokens)"
        )
    if prefill:
        parts.append(f"prefill attention up to {prefill['fraction_of_matmul']:.0%} of matmul")
    return "; ".join(parts)


def model_step(args, record: StepRecord, out: Path) -> str:  # noqa: ANN001
    from pdserve.bench import model_step as bench

    data = bench.main(["--json", str(out)] + ([] if args.long else ["--quick"]))
    record.data = data
    record.figures = {"copy_gbps": data["copy_gbps"], "matmul_tflops": data["matmul_tflops"]}
    decode = [r for r in data["decode"] if r["batch"] >= 64]
    prefill = [r for r in data["prefill"] if r["prompt_len"] >= 2048]
    parts = [f"{data['device']}, {data['preset']} {data['dtype']}"]
    if decode:
        worst = min(decode, key=lambda r: r["fraction_of_copy"])
        parts.append(f"decode at batch >= 64: {worst['fraction_of_copy']:.0%} of copy at worst")
    if prefill:
        worst = min(prefill, key=lambda r: r["fraction_of_matmul"])
        parts.append(f"2k prefill: {worst['fraction_of_matmul']:.0%} of matmul at worst")
    return "; ".join(parts)


def moe(args, record: StepRecord, out: Path) -> str:  # noqa: ANN001
    from pdserve.bench import moe as bench

    data = bench.main(["--json", str(out)] + ([] if args.long else ["--quick"]))
    record.data = data
    record.figures = {"copy_gbps": data["copy_gbps"], "matmul_tflops": data["matmul_tflops"]}
    rows = data["rows"]
    parts = [f"{data['device']}, {data['dtype']}"]
    if rows:
        big, one = rows[-1], rows[0]
        parts.append(
            f"fused MoE at {big['tokens']} tokens: {big['fraction_of_matmul']['triton']:.0%} of "
            f"matmul, {big['moe_ms']['triton'] / big['dense_ms']:.2f}x a dense MLP of its active "
            f"width; at {one['tokens']} token {one['fraction_of_copy']['triton']:.0%} of copy"
        )
        parts.append(
            f"Triton {one['moe_ms']['torch'] / one['moe_ms']['triton']:.1f}x the reference at "
            f"{one['tokens']} token, {big['moe_ms']['torch'] / big['moe_ms']['triton']:.1f}x at "
            f"{big['tokens']}"
        )
    small = [r for r in rows if r["tokens"] <= 8]  # the split-K schedule
    if small:
        worst = min(small, key=lambda r: r["fraction_of_copy"]["triton"])
        parts.append(
            f"1-8 tokens: {worst['fraction_of_copy']['triton']:.0%} of copy at worst "
            f"({worst['tokens']} token{'s' if worst['tokens'] != 1 else ''})"
        )
    return "; ".join(parts)


def quant_gemm(args, record: StepRecord, out: Path) -> str:  # noqa: ANN001
    from pdserve.bench import quant_gemm as bench

    data = bench.main(["--json", str(out)])
    record.data = data
    rows = data["rows"]
    for r in rows:
        if not r["equal"]:
            record.fail(
                f"{r['kernel']} {'x'.join(map(str, r['weight']))} at {r['rows']} rows",
                f"differs from its reference by {r['max_error']:.1e} of the largest output "
                f"(tolerance {r['tolerance']:.0e})",
            )
    record.figures = {
        f"{r['kernel']}_{'x'.join(map(str, r['weight']))}_m{r['rows']}_x_bf16": r["speedup"]
        for r in rows
    }
    parts = [data["device"]]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        one, big = min(mine, key=lambda r: r["rows"]), max(mine, key=lambda r: r["rows"])
        parts.append(
            f"{kernel} {one['speedup']:.2f}x cuBLAS bf16 at {one['rows']} row, "
            f"{big['speedup']:.2f}x at {big['rows']}"
        )
    equal = sum(r["equal"] for r in rows)
    parts.append(f"{equal} of {len(rows)} cases equal to their reference")
    return "; ".join(parts)


def kv_transfer(args, record: StepRecord, out: Path) -> str:  # noqa: ANN001
    from pdserve.bench import kv_transfer as bench

    saved = sys.argv
    sys.argv = ["pdserve.bench.kv_transfer", "--transports", "cuda_ipc", "--json", str(out)]
    try:
        bench.main()
    finally:
        sys.argv = saved
    data = json.loads(out.read_text())
    record.data = {"results": data}
    rows = data if isinstance(data, list) else data.get("rows", [])
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None and r.get("blocks", 0) >= 64]
    if ratios:
        record.figures["min_ratio_from_64_blocks"] = min(ratios)
        return f"cuda_ipc from 64 blocks: {min(ratios):.0%} of a device copy at worst"
    return "cuda_ipc measured"


BENCHES = {
    "kernels": kernels,
    "model_step": model_step,
    "moe": moe,
    "quant_gemm": quant_gemm,
    "kv_transfer": kv_transfer,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m pdserve.deploy.gpu_check.bench_steps {{{','.join(BENCHES)}}} ...")
        return 2
    name = argv.pop(0)
    args = step_args(f"gpu-check step {name}", argv)
    record = StepRecord(args.json)
    try:
        import torch

        if not torch.cuda.is_available():
            record.finish("no CUDA device", status="skipped")
            return 0
        summary = BENCHES[name](args, record, Path(args.work) / f"{name}.json")
    except Exception as exc:  # noqa: BLE001 (the record says what broke; the log has the trace)
        import traceback

        traceback.print_exc()
        record.fail(name, f"{type(exc).__name__}: {exc}")
        record.finish(f"{name} broke")
        return 1
    record.finish(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
