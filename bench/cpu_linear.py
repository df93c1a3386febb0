"""The packed linear layers of CPU nodes (`pdserve.engine.cpu.linear`), side by side in one process: their
time per call at each row count against oneDNN called on the rows as they come (what the engine
did before it padded them) and against F.linear; and the memory oneDNN keeps for the row counts
each way meets.

    python -m pdserve.bench.cpu_linear                          # pdserve-stories' projection shapes
    python -m pdserve.bench.cpu_linear --shape 4096x4096 --rows 1,8,64,300,1000 --threads 2

A row count is timed by alternating the three ways call by call, `--repeat` calls each; the memory
figures come from fresh processes, one per way, calling every row count of `--memory-rows` once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from pdserve.engine.cpu import linear as cpu_linear
from pdserve.tune import provenance

# pdserve-stories: qkv, o, gate_up, down and lm_head as (out, in).
STORIES_SHAPES = ["384x256", "256x256", "1536x256", "256x768", "782x256"]


def unpadded(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def ways(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, cpu_linear.BATCH_HINT)
    return {
        "padded": lambda x: cpu_linear.linear(x, weight, None, packed),
        "unpadded": lambda x: unpadded(x, packed),
        "f_linear": lambda x: F.linear(x, weight),
    }


def time_rows(weight: torch.Tensor, rows: int, repeat: int) -> dict[str, float]:
    """Median microseconds per call of each way, the ways alternating call by call; and
    `first_unpadded`, the first call at this row count as it comes (oneDNN builds its kernel)."""
    x = torch.randn(rows, weight.shape[1])
    fns = ways(weight)
    start = time.perf_counter()
    fns["unpadded"](x)
    first = time.perf_counter() - start
    for fn in fns.values():  # kernels built and caches warm before timing
        fn(x)
        fn(x)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    medians = {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}
    return medians | {"first_unpadded": round(first * 1e6, 1)}


# Run in a fresh process: argv is the way, the shape and N; prints the MiB gained calling every
# row count 1..N once.
MEMORY_CHILD = """
import sys, torch
from pdserve.bench.cpu_linear import parse_shape, ways
torch.set_num_threads(1)
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
way, shape, n = sys.argv[1], parse_shape(sys.argv[2]), int(sys.argv[3])
fn = ways(torch.randn(*shape))[way]
x = torch.randn(n, shape[1])
fn(x[:1])
before = rss_mib()
for m in range(1, n + 1):
    fn(x[:m])
print(rss_mib() - before)
"""


def memory_child(way: str, shape: str, n: int) -> float:
    """MiB a fresh process gains calling `way` at every row count 1..n once."""
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, way, shape, str(n)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return round(float(out.stdout.split()[-1]), 1)


def parse_shape(text: str) -> tuple[int, int]:
    out_features, in_features = text.lower().split("x")
    return int(out_features), int(in_features)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.cpu_linear",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", action="append", help="OUTxIN (repeat; default: pdserve-stories')")
    p.add_argument("--rows", default="1,3,8,17,33,100,200,300,700,1000,2000")
    p.add_argument("--repeat", type=int, default=40, help="timed calls of each way per row count")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--memory-rows",
        type=int,
        default=1024,
        help="memory: every row count 1..N, in a fresh process per way",
    )
    p.add_argument("--json-out", type=Path)
    return p.parse_args(argv)


def docs_table(results: dict, rows: str = "1,17,100,300,1000,2000") -> str:
    """Microseconds per call, padded / as the rows come, at the given row counts; then the first
    call's time and the memory gained, in a sentence each."""
    counts = rows.split(",")
    times, memory = results["times_us"], results["memory_mib"]
    lines = [
        "| shape | "
        + " | ".join(f"{int(m):,} row{'s' if m != '1' else ''}" for m in counts)
        + " |",
        "| --- |" + " ---: |" * len(counts),
    ]
    for shape, by_rows in times.items():
        cells = [
            f"{by_rows[m]['padded']:.0f} / {by_rows[m]['unpadded']:.0f} "
            f"({by_rows[m]['padded'] / by_rows[m]['unpadded']:.2f}x)"
            for m in counts
        ]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")

    def first(group: list[str]) -> str:
        calls = [times[shape][m]["first_unpadded"] for shape in times for m in group]
        return f"{min(calls):.0f}-{max(calls):.0f}"

    small = [m for m in counts if int(m) <= 100]
    spans = [f"{first(small)} at {small[0]} to {small[-1]} rows"] if small else []
    spans += [f"{first([m])} at {int(m):,}" for m in counts if int(m) > 100]
    used = "; ".join(
        f"{shape} {mem['padded']:.1f} / {mem['unpadded']:.1f}" for shape, mem in memory.items()
    )
    rows_max = results.get("memory_rows", 1024)
    lines += [
        "",
        "The first call at a row count as it comes (oneDNN builds its kernel), microseconds: "
        + ", ".join(spans)
        + ".",
        "",
        f"Memory gained calling every row count 1-{rows_max:,} once (MiB), padded / as the rows "
        f"come: {used}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if not torch.backends.mkldnn.is_available():
        print("this torch build has no oneDNN")
        return 1
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = args.shape or STORIES_SHAPES
    rows = [int(r) for r in args.rows.split(",")]
    record = provenance.start(sys.argv if argv is None else [__file__, *argv])
    results: dict = {
        "threads": args.threads,
        "times_us": {},
        "memory_mib": {},
    }
    print(
        f"microseconds per call (median of {args.repeat}), {args.threads} thread(s); "
        "ratio: padded / unpadded"
    )
    print("| shape | rows | padded | unpadded | F.linear | ratio | unpadded, first call |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in shapes:
        weight = torch.randn(*parse_shape(shape))
        results["times_us"][shape] = {}
        for m in rows:
            t = time_rows(weight, m, args.repeat)
            results["times_us"][shape][str(m)] = t
            print(f"{shape}, {m} rows: {t}", flush=True)
    for shape in shapes:
        mem = {way: memory_child(way, shape, args.memory_rows) for way in ("padded", "unpadded")}
        results["memory_mib"][shape] = mem
    results = provenance.finish(record) | results | {"memory_rows": args.memory_rows}
    print(docs_table(results, rows=",".join(str(r) for r in rows)))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
