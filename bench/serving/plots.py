"""Sweeps of several systems on one figure: throughput against P99 TPOT, TTFT and end-to-end
latency; SLO attainment, goodput and the short requests' P99 TPOT against the offered rate. `python -m pdserve.bench.serving.plots A.json B.json
-o fig.png` plots saved sweeps (one sweep or a list of sweeps per file)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.serving.sweep import curve

LINESTYLES = ("-", "--", ":", "-.")


def plot_sweeps(sweeps: Sequence[dict], out: str | Path, title: str = "") -> Path:
    """One figure, six panels; a system keeps its colour across its variants (workloads),
    which differ by line style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    systems = list(dict.fromkeys(s.get("system", s["label"]) for s in sweeps))
    variants = list(dict.fromkeys(s.get("variant", "") for s in sweeps))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    panels = (
        (
            axes[0, 0],
            "request_throughput",
            "tpot_ms.p99",
            "request throughput (req/s)",
            "P99 TPOT (ms)",
            True,
        ),
        (
            axes[0, 1],
            "request_throughput",
            "ttft_ms.p99",
            "request throughput (req/s)",
            "P99 TTFT (ms)",
            True,
        ),
        (
            axes[0, 2],
            "request_throughput",
            "e2el_ms.p99",
            "request throughput (req/s)",
            "P99 end-to-end latency (ms)",
            True,
        ),
        (axes[1, 0], "rate", "slo_attainment", "offered rate (req/s)", "SLO attainment", False),
        (axes[1, 1], "rate", "goodput", "offered rate (req/s)", "goodput (req/s)", False),
        (
            axes[1, 2],
            "rate",
            "by_kind.short.tpot_ms.p99",
            "offered rate (req/s)",
            "short requests' P99 TPOT (ms)",
            True,
        ),
    )
    for ax, x, y, xlabel, ylabel, log_y in panels:
        for sweep in sweeps:
            try:
                points = curve(sweep, x, y)
            except KeyError:  # e.g. no requests of the short kind in this workload
                continue
            color = colors[systems.index(sweep.get("system", sweep["label"])) % len(colors)]
            style = LINESTYLES[variants.index(sweep.get("variant", "")) % len(LINESTYLES)]
            ax.plot(*zip(*points), style, marker="o", color=color, label=sweep["label"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.3)
    if sweeps and sweeps[0]["points"]:
        slo = sweeps[0]["points"][0]["summary"]["slo"]
        axes[0, 0].axhline(slo["tpot_ms"], color="grey", linewidth=0.8, linestyle=":")
        axes[0, 1].axhline(slo["ttft_ms"], color="grey", linewidth=0.8, linestyle=":")
        axes[1, 0].set_title(
            f"SLO: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms"
        )
    axes[1, 0].set_ylim(-0.05, 1.05)
    axes[0, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "sweeps",
        nargs="+",
        help="sweep JSON files (bench.serve_load --rate a,b, or bench.compare's results)",
    )
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    sweeps: list[dict] = []
    for path in args.sweeps:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and "sweeps" in data:  # bench.compare's results
            data = data["sweeps"]
        sweeps.extend(data if isinstance(data, list) else [data])
    print(plot_sweeps(sweeps, args.output, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
