"""The CPU paged-attention kernel against the torch reference, and against another version of its
C source, side by side in one run: decode steps (one query per sequence) over a pool whose blocks
are shuffled, as a serving pool's are, at one thread and at all of them.

    .venv/bin/python -m pdserve.bench.cpu_attention
    git show REV:kernels/csrc/paged_attention_cpu.c > /tmp/old.c
    .venv/bin/python -m pdserve.bench.cpu_attention --other-source /tmp/old.c --threads 1 \\
        --json-out bench/results/cpu_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.bench import kernels
from pdserve.bench.model_step import median_ms
from pdserve.kernels import attention_ref, paged_attention_cpu
from pdserve.tune import provenance

# name: (query heads, KV heads, head_dim), as the peer benchmark's models.
SHAPES = {"llama-9m": (8, 4, 32), "llama-50m": (8, 4, 64), "qwen3-25m": (6, 2, 128)}
BLOCK_SIZE = kernels.BLOCK_SIZE


@dataclass(slots=True)
class Row:
    shape: str
    batch: int
    context: int
    threads: int
    kernel_us: float
    other_us: float | None
    reference_us: float


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def decode_inputs(batch: int, context: int, heads: tuple[int, int, int], seed: int = 0) -> dict:
    """One decode step's inputs: `batch` sequences of `context` cached tokens each, on shuffled
    pages of one float32 CPU pool."""
    return kernels.paged_inputs(
        [context] * batch, [1] * batch, seed, heads, device="cpu", dtype=torch.float32
    )


def measure(shape: str, batch: int, context: int, threads: int, other, reps: int) -> Row:
    inputs = decode_inputs(batch, context, SHAPES[shape])
    torch.set_num_threads(threads)
    rotate = [paged_attention_cpu.paged_attention, None, attention_ref.paged_attention]
    if other is not None:
        rotate[1] = lambda **kw: paged_attention_cpu.paged_attention(**kw, library=other)
    times: list[list[float]] = [[], [], []]
    # Interleaved, a few reps at a time, so that drift falls on every version alike.
    for _ in range(5):
        for i, fn in enumerate(rotate):
            if fn is not None:
                ms = median_ms(lambda fn=fn: fn(**inputs), "cpu", max(1, reps // 5), warmup=1)
                times[i].append(ms * 1e3)
    mine, theirs, ref = (statistics.median(t) if t else None for t in times)
    return Row(shape, batch, context, threads, mine, theirs, ref)


def docs_table(results: dict) -> str:
    """The rows as the docs show them: µs per call of each way, and the others over the kernel."""
    other = results.get("other")
    head = "| shape | batch | context | threads | kernel µs |"
    head += f" {other} µs | {other} / kernel |" if other else ""
    lines = [head + " torch ref µs | ref / kernel |", "| --- |" + " ---: |" * (8 if other else 6)]
    for r in results["rows"]:
        vs = f" {r['other_us']:.1f} | {r['other_us'] / r['kernel_us']:.2f}x |" if other else ""
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['threads']} | "
            f"{r['kernel_us']:.1f} |{vs} {r['reference_us']:.1f} | "
            f"{r['reference_us'] / r['kernel_us']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    p.add_argument("--batches", type=_ints, default=[1, 48, 128])
    p.add_argument("--contexts", type=_ints, default=[160, 512])
    p.add_argument("--threads", type=_ints, default=[1, torch.get_num_threads()])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--other-source", type=Path, help="another version of the kernel's C source")
    p.add_argument("--json-out", type=Path, help="the results file")
    args = p.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape {unknown[0]!r}: choose from {', '.join(SHAPES)}")
    if not paged_attention_cpu.available():
        print("pdserve.bench.cpu_attention: the C kernel did not build here (no C compiler?)")
        return 1
    other = None
    if args.other_source is not None:
        other = paged_attention_cpu.build(args.other_source.resolve())
        if other is None:
            p.error(f"{args.other_source} did not build")
    print(
        f"# float32, block {BLOCK_SIZE}, blocks shuffled over the pool; "
        f"torch {torch.backends.cpu.get_cpu_capability()}",
        flush=True,
    )
    record = provenance.start(sys.argv if argv is None else [__file__, *argv])
    rows = []
    for shape in shapes:
        for context in args.contexts:
            for batch in args.batches:
                for threads in args.threads:
                    rows.append(measure(shape, batch, context, threads, other, args.reps))
                    print(f"{shape} batch {batch} context {context} threads {threads}", flush=True)
    results = provenance.finish(record) | {
        "other": args.other_source.stem if other else None,
        "reps": args.reps,
        "rows": [asdict(r) for r in rows],
    }
    print(docs_table(results))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
