"""Step `tiles`: a sweep of the Triton attention kernels' tunables (kernels/triton_attention.py:
TileConfig's block_m, block_n, num_warps and num_stages; the decode split's partition) at
Llama-3-8B attention shapes in bfloat16. Every configuration is checked against the torch
reference on the same inputs before it is timed, and compared with the shipped defaults
(`decode_config`, `prefill_config`), which were chosen from compiles, not timings.

    python -m pdserve.deploy.gpu_check.tiles --json tiles.json            # the quick sweep
    python -m pdserve.deploy.gpu_check.tiles --json tiles.json --long     # the full grid, for the docs
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.deploy.gpu_check.record import Deadline, StepRecord, step_args

# Attention outputs in bfloat16 against the reference in bfloat16 (tests/test_gpu_engine.py).
TOLERANCE = dict(atol=2e-2, rtol=2e-2)
# Cases in the order they run: a decode and a prefill case first, so that a sweep cut short by
# its time box still has both kinds.
QUICK = {
    "cases": [("decode", 64, 4096), ("prefill", 1, 2048), ("decode", 256, 512)],
    "decode_grid": dict(block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3]),
    "partitions": [],
    "prefill_grid": dict(block_m=[64, 128], block_n=[32, 64], num_warps=[4, 8], num_stages=[2, 3]),
}
LONG = {
    "cases": [
        ("decode", 64, 4096),
        ("prefill", 1, 2048),
        ("decode", 256, 512),
        ("decode", 1, 4096),
        ("decode", 16, 4096),
        ("decode", 256, 4096),
        ("prefill", 4, 2048),
    ],
    "decode_grid": dict(block_n=[16, 32, 64, 128], num_warps=[2, 4, 8], num_stages=[2, 3, 4]),
    "partitions": [128, 256, 512, 1024, 2048],
    "prefill_grid": dict(
        block_m=[64, 128, 256], block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3, 4]
    ),
}
# do_bench's warm-up and repetitions, in ms: shorter than bench.kernels', many configs to time.
WARMUP_MS, REP_MS = 10, 60
TUNABLES = ("block_m", "block_n", "num_warps", "num_stages")


@dataclass(slots=True)
class Case:
    """One shape to sweep: how to run a configuration on it, and what it must compute."""

    kind: str  # decode | prefill
    shape: tuple[int, int]  # (batch, context) or (prompts, prompt length)
    default: Any  # TileConfig
    run_with: Callable[..., Callable[[], torch.Tensor]]  # (config, **options) -> a launch
    expected: torch.Tensor
    fraction: Callable[[float], float]  # ms -> fraction of the device's ceiling

    @property
    def label(self) -> str:
        return f"{self.kind} {self.shape[0]}x{self.shape[1]}"


def grid(axes: dict[str, list[int]], fixed: dict[str, int]) -> list:
    from pdserve.kernels.triton_attention import TileConfig

    names = list(axes)
    return [
        TileConfig(**{**fixed, **dict(zip(names, values))})
        for values in itertools.product(*(axes[n] for n in names))
    ]


def try_config(run: Callable[[], torch.Tensor], expected: torch.Tensor) -> tuple[float | None, str]:
    """(median ms, "") for a launch that computes the reference's result; (None, why) for one
    that does not compile or does not match."""
    from triton.testing import do_bench

    try:
        got = run()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 (out of shared memory or registers: a finding)
        return None, f"does not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if not torch.allclose(got.float(), expected.float(), **TOLERANCE):
        err = (got.float() - expected.float()).abs().max().item()
        return None, f"wrong result: max abs error {err:.3g}"
    return float(do_bench(run, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")), ""


def sweep(record: StepRecord, case: Case, configs: list, deadline: Deadline) -> None:
    """Time `configs` (the default first) on one case; rows and the best one go in the record."""
    ordered = [case.default] + [c for c in configs if c != case.default]
    rows = []
    for done, config in enumerate(ordered):
        if deadline.left() < 5:
            record.note(f"{case.label}: stopped at the time box after {done} of {len(ordered)}")
            break
        ms, why = try_config(case.run_with(config), case.expected)
        row = {"case": list(case.shape), **asdict(config), "default": config == case.default}
        row |= {"ms": ms, "fraction": None if ms is None else case.fraction(ms)}
        if why:
            row["problem"] = why
            if config == case.default:
                record.fail(case.label, f"the default {config}: {why}")
        rows.append(row)
        record.data.setdefault(case.kind, []).append(row)
        record.save()
    timed = [r for r in rows if r["ms"] is not None]
    base = next((r for r in timed if r["default"]), None)
    if base is None:
        return
    best = min(timed, key=lambda r: r["ms"])
    record.figures[case.label] = {
        "default_ms": base["ms"],
        "best_ms": best["ms"],
        "speedup": base["ms"] / best["ms"],
        "best": {k: best[k] for k in TUNABLES},
        "default_fraction": base["fraction"],
        "best_fraction": best["fraction"],
    }
    record.save()


def decode_case(batch: int, context: int, copy_gbps: float) -> Case:
    from pdserve.bench.kernels import HEAD_DIM, NUM_KV_HEADS, paged_inputs
    from pdserve.kernels import attention_ref
    from pdserve.kernels.triton_attention import decode_config, paged_decode_attention

    s = paged_inputs([context] * batch, [1] * batch)
    kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * s["k_cache"].element_size()

    def run_with(config, partition: int | None = None) -> Callable[[], torch.Tensor]:  # noqa: ANN001
        def run() -> torch.Tensor:
            out = torch.empty_like(s["query"])
            return paged_decode_attention(
                s["query"],
                s["k_cache"],
                s["v_cache"],
                s["block_tables"],
                s["seq_lens"],
                s["scale"],
                out,
                partition=partition,
                config=config,
            )

        return run

    return Case(
        "decode",
        (batch, context),
        decode_config(HEAD_DIM, s["k_cache"].dtype),
        run_with,
        attention_ref.paged_attention(**s),
        lambda ms: kv_bytes / (ms * 1e-3) / 1e9 / copy_gbps,  # K and V read, of copy bandwidth
    )


def prefill_case(prompts: int, prompt_len: int, matmul_tflops: float) -> Case:
    from pdserve.bench.kernels import HEAD_DIM, NUM_HEADS, paged_inputs
    from pdserve.kernels import attention_ref
    from pdserve.kernels.triton_attention import paged_prefill_attention, prefill_config

    s = paged_inputs([prompt_len] * prompts, [prompt_len] * prompts)
    # Causal: query i attends to i + 1 keys; QK^T and PV are 2 flops per multiply-add each.
    flop = prompts * 4 * NUM_HEADS * HEAD_DIM * (prompt_len * (prompt_len + 1) // 2)

    def run_with(config) -> Callable[[], torch.Tensor]:  # noqa: ANN001
        def run() -> torch.Tensor:
            out = torch.empty_like(s["query"])
            return paged_prefill_attention(
                s["query"],
                s["k_cache"],
                s["v_cache"],
                s["block_tables"],
                s["seq_lens"],
                s["query_start_loc"],
                s["scale"],
                out,
                config=config,
            )

        return run

    return Case(
        "prefill",
        (prompts, prompt_len),
        prefill_config(HEAD_DIM, s["k_cache"].dtype),
        run_with,
        attention_ref.paged_attention(**s),
        lambda ms: flop / (ms * 1e-3) / 1e12 / matmul_tflops,  # of the bf16 matmul rate
    )


def sweep_partitions(record: StepRecord, case: Case, partitions: list[int], deadline) -> None:  # noqa: ANN001
    """The default tiles with the decode split's partition forced (tokens per split)."""
    for partition in partitions:
        if deadline.left() < 5 or partition % case.default.block_n:
            continue
        ms, why = try_config(case.run_with(case.default, partition), case.expected)
        row = {"case": list(case.shape), "partition": partition, "ms": ms, "problem": why}
        row["fraction"] = None if ms is None else case.fraction(ms)
        record.data.setdefault("partitions", []).append(row)
        record.save()


def main(argv: list[str] | None = None) -> int:
    args = step_args(__doc__.split("\n\n")[0], argv)
    record = StepRecord(args.json)
    if not torch.cuda.is_available():
        record.finish("no CUDA device", status="skipped")
        return 0
    from pdserve.bench.kernels import measure_limits

    plan = LONG if args.long else QUICK
    limits = measure_limits()
    copy, matmul = limits.copy_gbps, limits.matmul_tflops
    record.data.update(copy_gbps=copy, matmul_tflops=matmul, grid=plan)
    record.save()
    for kind, n, length in plan["cases"]:
        if kind == "prefill":
            case = prefill_case(n, length, matmul)
            sweep(record, case, grid(plan["prefill_grid"], {}), args.deadline)
        else:
            case = decode_case(n, length, copy)
            fixed = {"block_m": case.default.block_m}  # decode does not use block_m
            sweep(record, case, grid(plan["decode_grid"], fixed), args.deadline)
            sweep_partitions(record, case, plan["partitions"], args.deadline)
        del case
        torch.cuda.empty_cache()
    faster = [k for k, f in record.figures.items() if f["speedup"] > 1.05]
    swept = sum(len(record.data.get(k, [])) for k in ("decode", "prefill"))
    verdict = (
        f"faster than the default at {', '.join(faster)}"
        if faster
        else "the defaults are within 5% of the best everywhere"
    )
    record.finish(f"{swept} configurations timed; {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
