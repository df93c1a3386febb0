"""A served comparison run in rounds (`pdserve.bench.compare --rounds N`), read back from its
results file: each system's goodput per workload and rate as the median over the rounds with
its spread, a system's lead over a peer round by round, the aim, and where each system's CPU
went per generated token."""

from __future__ import annotations

import statistics
from collections import defaultdict

from pdserve.bench.serving.cpu_use import KINDS, OTHER, kind_ms_per_token

NAMES = {"vllm": "vLLM", "tuned": "pdserve tuned"}


def _name(system: str) -> str:
    return NAMES.get(system, f"pdserve {system}")


def points(results: dict) -> dict[tuple[str, str, float], dict[int, dict]]:
    """(system, workload, rate) -> {round: the point's result}."""
    out: dict = defaultdict(dict)
    for sweep in results["sweeps"]:
        for point in sweep["points"]:
            key = (sweep["system"], sweep["variant"], point["config"]["rate"])
            out[key][sweep.get("round", 1)] = point
    return out


def _spread(values: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    med = fmt.format(statistics.median(values)) + unit
    if len(values) < 2:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def ratios(results: dict, system: str, peer: str, variant: str, rate: float) -> list[float]:
    """system's goodput / peer's, in each round both ran (a round where the peer served none
    gives infinity)."""
    by = points(results)
    mine, theirs = by.get((system, variant, rate), {}), by.get((peer, variant, rate), {})
    out = []
    for rnd in sorted(set(mine) & set(theirs)):
        a, b = mine[rnd]["summary"]["goodput"], theirs[rnd]["summary"]["goodput"]
        out.append(a / b if b else float("inf"))
    return out


def _layout(results: dict) -> tuple[list[str], list[str], list[float]]:
    sweeps = results["sweeps"]
    systems = list(dict.fromkeys(s["system"] for s in sweeps))
    variants = list(dict.fromkeys(s["variant"] for s in sweeps))
    rates = sorted({p["config"]["rate"] for s in sweeps for p in s["points"]})
    return systems, variants, rates


def docs_rounds(results: dict, lead: str = "tuned", peer: str = "vllm") -> str:
    """Goodput (req/s) per workload and rate: each system's median over the rounds with its
    range, `lead`'s ratio to `peer` (median of the rounds' ratios, with their range), both
    systems' median P99 TPOT and P50 gap between chunks (near 0 where tokens come in bursts),
    and the most CPU other processes took during any of the point's runs."""
    systems, variants, rates = _layout(results)
    by = points(results)
    rounds = len({s.get("round", 1) for s in results["sweeps"]})
    head = [f"{_name(s)} goodput" for s in systems]
    lines = [
        f"| workload | rate (req/s) | {' | '.join(head)} | {_name(lead)} / {_name(peer)} "
        f"| P99 TPOT (ms), {_name(lead)} / {_name(peer)} | P50 ITL (ms), {_name(lead)} / "
        f"{_name(peer)} | other processes (cores, most) |",
        "| --- | ---: | " + " | ".join("---:" for _ in systems) + " | ---: | ---: | ---: | ---: |",
    ]
    for variant in variants:
        for rate in rates:
            cells = []
            for s in systems:
                runs = by.get((s, variant, rate), {})
                cells.append(
                    _spread([p["summary"]["goodput"] for p in runs.values()]) if runs else "n/a"
                )
            r = ratios(results, lead, peer, variant, rate)
            ratio = _spread(r, unit="x") if r else "n/a"
            tpot, itl = [], []
            for s in (lead, peer):
                runs = by.get((s, variant, rate), {}).values()
                for out, key in ((tpot, ("tpot_ms", "p99")), (itl, ("itl_ms", "p50"))):
                    values = [p["summary"][key[0]][key[1]] for p in runs]
                    out.append(f"{statistics.median(values):.1f}" if values else "n/a")
            others = [
                p["cpu"]["others_cores"]
                for s in systems
                for p in by.get((s, variant, rate), {}).values()
                if p.get("cpu") and p["cpu"].get("others_cores") is not None
            ]
            busy = f"{max(others):.2f}" if others else "n/a"
            lines.append(
                f"| {variant} | {rate:g} | {' | '.join(cells)} | {ratio} | {' / '.join(tpot)} "
                f"| {' / '.join(itl)} | {busy} |"
            )
    note = f"Medians over {rounds} rounds, the range in brackets." if rounds > 1 else "One round."
    return note + "\n\n" + "\n".join(lines)


def aim_lines(
    results: dict, lead: str = "tuned", peer: str = "vllm", aim: float = 1.2
) -> list[str]:
    """Per workload and rate whether `lead` serves at least `aim` x `peer`'s goodput (median of
    the rounds' ratios) with every round's ratio above 1 (the lead larger than its spread), and
    a P99 TPOT (median) no worse than the peer's."""
    _, variants, rates = _layout(results)
    by = points(results)
    out = []
    for variant in variants:
        for rate in rates:
            r = ratios(results, lead, peer, variant, rate)
            if not r:
                continue
            tpot = [
                statistics.median(
                    p["summary"]["tpot_ms"]["p99"] for p in by[(s, variant, rate)].values()
                )
                for s in (lead, peer)
            ]
            med = statistics.median(r)
            ok = med >= aim and min(r) > 1.0 and tpot[0] <= tpot[1]
            out.append(
                f"- {variant}, {rate:g} req/s: {_name(lead)} / {_name(peer)} goodput "
                f"{med:.2f}x (rounds {min(r):.2f}–{max(r):.2f}x), P99 TPOT {tpot[0]:.1f} vs "
                f"{tpot[1]:.1f} ms: **{'met' if ok else 'missed'}**"
            )
    return out


def docs_aim(results: dict, lead: str = "tuned", peer: str = "vllm", aim: float = 1.2) -> str:
    lines = aim_lines(results, lead, peer, aim)
    met = sum(line.endswith("**met**") for line in lines)
    head = (
        f"Aim: {_name(lead)} serves at least {aim:g}x {_name(peer)}'s goodput at every rate "
        f"(median of the rounds, every round above 1x), with P99 TPOT no worse: met at {met} "
        f"of {len(lines)} points."
    )
    return head + "\n\n" + "\n".join(lines)


def _pooled(results: dict, system: str, variant: str, rate: float) -> dict[str, dict]:
    """Each role's CPU over every round of one point, pooled: seconds, ZeroMQ's seconds, samples
    and tokens summed, so ms per token is a ratio of sums."""
    runs = points(results).get((system, variant, rate), {})
    tokens = sum(p["cpu"]["tokens"] for p in runs.values() if p.get("cpu"))
    roles: dict[str, dict] = {}
    for p in runs.values():
        for role, r in (p.get("cpu") or {}).get("roles", {}).items():
            acc = roles.setdefault(role, {"cpu_s": 0.0, "zmq_s": 0.0, "samples": defaultdict(int)})
            acc["cpu_s"] += r["cpu_s"]
            acc["zmq_s"] += r["zmq_s"]
            for kind, n in r["samples"].items():
                acc["samples"][kind] += n
    for acc in roles.values():
        acc["ms_per_token"] = acc["cpu_s"] / tokens * 1e3 if tokens else None
    return roles


def docs_cpu(results: dict, rate: float | None = None, variant: str = "mixed") -> str:
    """CPU ms per generated token at one rate (default: the highest) and workload, a column per
    system and process, a row per kind of work: each process's CPU time (over every round,
    from /proc), ZeroMQ's I/O threads as measured, and the rest split as py-spy's samples of
    its Python threads split."""
    systems, _, rates = _layout(results)
    rate = rates[-1] if rate is None else float(rate)  # a docs marker's option is text
    columns = []
    for system in systems:
        for role, r in sorted(_pooled(results, system, variant, rate).items()):
            if r["ms_per_token"] is not None and r["cpu_s"] > 0:
                columns.append((f"{_name(system)}: {role.removeprefix('vLLM ')}", r))
    if not columns:
        return ""
    split = [kind_ms_per_token(r) for _, r in columns]
    kinds = [k for k, _ in KINDS] + [OTHER, "ZeroMQ I/O threads"]
    lines = [
        f"| CPU ms per token ({variant}, {rate:g} req/s) | "
        + " | ".join(c for c, _ in columns)
        + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |",
        "| **all of the process** | "
        + " | ".join(f"**{r['ms_per_token']:.3f}**" for _, r in columns)
        + " |",
    ]
    for kind in kinds:
        if not any(s.get(kind) for s in split):
            continue
        cells = [f"{s[kind]:.3f}" if s.get(kind) else ("–" if s else "n/a") for s in split]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    samples = [sum(r["samples"].values()) for _, r in columns]
    if any(samples):
        lines.append("| py-spy samples | " + " | ".join(str(n) for n in samples) + " |")
    totals = defaultdict(float)
    for column, r in columns:
        totals[column.split(":")[0]] += r["ms_per_token"]
    summary = "; ".join(f"{name} {ms:.3f} ms" for name, ms in totals.items())
    return "\n".join(lines) + f"\n\nCPU per generated token, all processes: {summary}."


def markdown(results: dict) -> str:
    """Everything a run in rounds shows: the rounds' table, the aim when both tuned and vLLM ran,
    and the CPU per token at the highest rate of each workload."""
    systems, variants, _ = _layout(results)
    parts = [settings_line(results), docs_rounds(results)]
    if "tuned" in systems and "vllm" in systems:
        parts.append(docs_aim(results))
    parts += [docs_cpu(results, variant=v) for v in variants]
    return "\n\n".join(p for p in parts if p)


def slo_line(results: dict) -> str:
    """The run's SLO and requests per rate, as the docs print them above its tables."""
    st = results["settings"]
    return (
        f"SLO: TTFT <= {st['slo_ttft_ms']:g} ms and TPOT <= {st['slo_tpot_ms']:g} ms. "
        f"Requests per rate: {st['duration_s']:g} s of arrivals, at least {st['min_requests']}."
    )


def settings_line(results: dict) -> str:
    st = results["settings"]
    rounds = st.get("rounds", 1)
    line = f"{slo_line(results)} {rounds} round{'s' * (rounds > 1)}, "
    line += f"{results['elapsed_s'] / 60:.1f} min in all."
    if n := st.get("competing_load"):
        line += f" {n} competing busy-loop process{'es' * (n > 1)} while the systems served."
    return line
