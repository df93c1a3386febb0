"""The comparison's results as Markdown: one row per system and rate, the TPOT interference of
long prompts (mixed against short-only), and the issue's aims as measured ratios."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.bench.serving.sweep import curve
from pdserve.tune.serving_metrics import throughput_at_latency


def _find(sweeps: Sequence[dict], system: str, variant: str) -> dict | None:
    return next((s for s in sweeps if s["system"] == system and s["variant"] == variant), None)


def results_table(sweeps: Sequence[dict]) -> str:
    head = (
        "| system | workload | rate (req/s) | done | req/s | out tok/s | TTFT p50 / p99 (ms) "
        "| TPOT p50 / p99 (ms) | ITL p99 (ms) | E2E p99 (ms) | SLO met | goodput (req/s) |"
    )
    rows = [head, "|" + " --- |" * 12]
    for sweep in sweeps:
        for point in sweep["points"]:
            s = point["summary"]
            rows.append(
                f"| {sweep['system']} | {sweep['variant']} | {point['config']['rate']:g} "
                f"| {s['completed']}/{s['num_requests']} | {s['request_throughput']:.2f} "
                f"| {s['output_token_throughput']:.0f} "
                f"| {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} "
                f"| {s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p99']:.1f} "
                f"| {s['itl_ms']['p99']:.1f} | {s['e2el_ms']['p99']:.0f} "
                f"| {s['slo_attainment']:.0%} | {s['goodput']:.2f} |"
            )
    return "\n".join(rows)


# The short requests' TPOT: the same kind of request in both workloads, the one long prompts hurt.
SHORT_TPOT_P99 = "by_kind.short.tpot_ms.p99"


def tpot_inflation(sweeps: Sequence[dict], system: str) -> list[tuple[float, float, float]]:
    """(rate, short requests' P99 TPOT short-only, the same mixed) at the rates both ran."""
    mixed, short = _find(sweeps, system, "mixed"), _find(sweeps, system, "short-only")
    if mixed is None or short is None:
        return []
    base = dict(curve(short, "rate", SHORT_TPOT_P99))
    return [(r, base[r], t) for r, t in curve(mixed, "rate", SHORT_TPOT_P99) if r in base]


def long_requests_table(sweeps: Sequence[dict]) -> str:
    """The long prompts' TTFT and gap from first to second token (client side), per point, and
    the coordinator's mean time from a first token to the decode node's first (over the sweep:
    every request's in a long-only sweep)."""
    rows = [
        "| system | workload | rate (req/s) | long requests | TTFT P50 (ms) | first-to-second token P50 (ms) | the same, P99 (ms) | first token to decode start, mean over the sweep (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sweep in sweeps:
        handoff = sweep.get("kv_handoff")
        decode_start = f"{handoff['mean_ms']:.1f} ({handoff['count']})" if handoff else "n/a"
        for point in sweep["points"]:
            long = point["summary"].get("by_kind", {}).get("long")
            if not long or not long["count"]:
                continue
            rows.append(
                f"| {sweep['system']} | {sweep['variant']} | {point['config']['rate']:g} | "
                f"{long['count']} | {long['ttft_ms']['p50']:.1f} | "
                f"{long['first_itl_ms']['p50']:.1f} | {long['first_itl_ms']['p99']:.1f} | "
                f"{decode_start} |"
            )
    return "\n".join(rows)


def interference_table(sweeps: Sequence[dict], systems: Sequence[str]) -> str:
    rows = [
        "| system | rate (req/s) | short requests' P99 TPOT, short-only (ms) | the same, mixed (ms) | mixed / short-only |",
        "| --- | --- | --- | --- | --- |",
    ]
    for system in systems:
        for rate, base, mixed in tpot_inflation(sweeps, system):
            rows.append(f"| {system} | {rate:g} | {base:.1f} | {mixed:.1f} | {mixed / base:.2f}x |")
    return "\n".join(rows)


def aims(
    sweeps: Sequence[dict],
    disagg: str,
    colocated: str,
    static: str | None,
    latency_limits_ms: Sequence[float] = (),
) -> list[str]:
    """The issue's aims, each as a line with the measured figures."""
    lines = []
    colo_inflation = {r: m / b for r, b, m in tpot_inflation(sweeps, colocated)}
    for rate, base, mixed in tpot_inflation(sweeps, disagg):
        ratio, colo = mixed / base, colo_inflation.get(rate)
        colo_text = f"{colo:.2f}x" if colo is not None else "n/a"
        verdict = "met" if ratio <= 1.5 and colo is not None and colo > ratio else "missed"
        lines.append(
            f"- TPOT interference at {rate:g} req/s: short requests' P99 TPOT with long prompts "
            f"mixed in is {ratio:.2f}x its short-only value disaggregated (aim <= 1.5x), "
            f"{colo_text} colocated ({verdict})"
        )
    d_mixed, c_mixed = _find(sweeps, disagg, "mixed"), _find(sweeps, colocated, "mixed")
    if d_mixed and c_mixed:
        good_c = dict(curve(c_mixed, "rate", "goodput"))
        for rate, good_d in curve(d_mixed, "rate", "goodput"):
            if rate in good_c:
                ratio = f"{good_d / good_c[rate]:.2f}x" if good_c[rate] > 0 else "inf"
                lines.append(
                    f"- Goodput at {rate:g} req/s (mixed): disaggregated {good_d:.2f} req/s, "
                    f"colocated {good_c[rate]:.2f} req/s ({ratio})"
                )
    for variant in ("mixed", "short-only"):
        cont = _find(sweeps, colocated, variant)
        stat = _find(sweeps, static, variant) if static else None
        if cont is None or stat is None:
            continue
        for limit in latency_limits_ms:
            c = throughput_at_latency(curve(cont, "request_throughput", "e2el_ms.p99"), limit)
            s = throughput_at_latency(curve(stat, "request_throughput", "e2el_ms.p99"), limit)
            text = lambda x: "none" if x is None else f"{x:.2f} req/s"  # noqa: E731
            ratio = f"{c / s:.2f}x" if c is not None and s else "n/a"
            lines.append(
                f"- Continuous over static ({variant}, colocated) at P99 end-to-end latency "
                f"<= {limit:g} ms: {text(c)} vs {text(s)}: {ratio}"
            )
    return lines


def sweeps_table(results: dict) -> str:
    """The results table of a `bench.compare` results file (`python -m pdserve.bench.docs`
    renders it)."""
    return results_table(results["sweeps"])
