"""Disaggregated against colocated serving, and continuous against static batching, in one run:
starts each pdserve configuration with `pdserve serve`, sweeps the same request rates against it
(a mostly-short workload with long prompts arriving mid-stream, and the same without them), and
prints the results table. The results JSON and the figure go to the work directory (or to
--results and --plot); with --write-docs, to bench/results/serving_compare.json and
docs/serving_sweep.png, and docs/benchmarks.md is rendered again from its results files.

    python -m pdserve.bench.compare
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from pdserve.bench import docs
from pdserve.bench.peers.competing_load import CompetingLoad
from pdserve.bench.peers.driver import VLLM_VENV, missing_peer
from pdserve.bench.peers.rounds import round_order
from pdserve.bench.serve_load import HelpFormatter
from pdserve.bench.serving import served_rounds
from pdserve.bench.serving.bench_model import BENCH_NAME, ensure_bench_model
from pdserve.bench.serving.cpu_use import CPUUse
from pdserve.bench.serving.plots import plot_sweeps
from pdserve.bench.serving.report import (
    aims,
    interference_table,
    long_requests_table,
    results_table,
)
from pdserve.bench.serving.sweep import run_sweep
from pdserve.bench.serving.vllm_server import VllmServer
from pdserve.tune import provenance
from pdserve.tune.load_generator import LoadConfig
from pdserve.tune.local_server import PdserveServer, PdserveSystem
from pdserve.tune.serving_workload import SyntheticWorkload
from pdserve.tune.slo import SLO

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where --write-docs puts the results, under the repository.
RESULTS, PLOT, DOC = (
    "bench/results/serving_compare.json",
    "docs/serving_sweep.png",
    "docs/benchmarks.md",
)

# The same node settings for every system; prefix caching stays on (prompts are random, so no
# request shares a prefix with another).
NODE_CONFIG = {"num_kv_blocks": 2048, "max_num_batched_tokens": 2048, "max_num_seqs": 256}
SYSTEMS = {
    "disaggregated": PdserveSystem("disaggregated", prefill_nodes=1, decode_nodes=1),
    "colocated": PdserveSystem("colocated", decode_nodes=2, colocated=True),
    "colocated-static": PdserveSystem(
        "colocated-static", decode_nodes=2, colocated=True, scheduling_policy="static"
    ),
}
# Not run unless named: prompts under 256 tokens prefilled on the decode node itself.
SYSTEMS["disaggregated-conditional"] = PdserveSystem(
    "disaggregated-conditional", config={"conditional_disagg_threshold": 256}
)
# Not run unless named: SendKV handled only between the prefill node's steps (no handoff thread).
SYSTEMS["disaggregated-between-steps"] = PdserveSystem(
    "disaggregated-between-steps", config={"kv_handoff": "between-steps"}
)
# Not run unless named: the cost of the cluster keys with KV pages over tcp (CurveZMQ on every
# socket, the default), against no keys at all and against KV pages authenticated only.
TCP = ("--transport", "tcp")
SYSTEMS["disaggregated-tcp-insecure"] = PdserveSystem(
    "disaggregated-tcp-insecure", flags=(*TCP, "--insecure")
)
SYSTEMS["disaggregated-tcp-curve"] = PdserveSystem("disaggregated-tcp-curve", flags=TCP)
SYSTEMS["disaggregated-tcp-kv-auth-only"] = PdserveSystem(
    "disaggregated-tcp-kv-auth-only", flags=TCP, config={"kv_encryption": False}
)
# Not run unless named: layer-wise KV streaming off and on (prompts of 512 tokens and more are
# admitted into the decode node when their prefill starts; pages leave layer by layer).
STREAMING = {"kv_streaming_min_prompt_tokens": 512}
SYSTEMS["disaggregated-no-streaming"] = PdserveSystem(
    "disaggregated-no-streaming", flags=TCP, config={**STREAMING, "kv_streaming": False}
)
SYSTEMS["disaggregated-streaming"] = PdserveSystem(
    "disaggregated-streaming", flags=TCP, config={**STREAMING, "kv_streaming": True}
)
DEFAULT_SYSTEMS = ["disaggregated", "colocated", "colocated-static"]
# Not run unless named: vLLM's OpenAI server (its CPU backend, from `make bench-peers`).
PEER_SYSTEMS = ("vllm",)
# Every system runs both by default; short-only is the reference for the TPOT interference of
# long prompts. long-only (not run unless named): every request a long prompt, so the
# coordinator's KV handoff histogram is the long requests' alone.
VARIANTS = ("mixed", "short-only", "long-only")
DEFAULT_VARIANTS = ["mixed", "short-only"]


def workloads(args: argparse.Namespace) -> dict[str, SyntheticWorkload]:
    mixed = SyntheticWorkload(
        short_prompt_len=args.short_prompt_len,
        short_output_len=args.short_output_len,
        long_fraction=args.long_fraction,
        long_prompt_len=args.long_prompt_len,
        long_output_len=args.long_output_len,
    )
    short = SyntheticWorkload(
        short_prompt_len=args.short_prompt_len, short_output_len=args.short_output_len
    )
    long = dataclasses.replace(mixed, long_fraction=1.0)
    return {"mixed": mixed, "short-only": short, "long-only": long}


def num_requests(args: argparse.Namespace, rate: float) -> int:
    return max(args.min_requests, round(rate * args.duration_s))


# Not run unless named: what `pdserve tune` picks for two workers on this machine, for each
# workload at the sweep's highest rate and the run's SLO (its profile measured first, unless
# --tune-profile gives one), served from the config file it writes.
TUNED = "tuned"


def tuned_systems(args: argparse.Namespace, work: Path, loads: dict) -> dict[str, PdserveSystem]:
    """The tuned configuration of each workload run, by workload."""
    from pdserve.bench.tune_validate import machine_profile, tune_pick
    from pdserve.tune.profile import Profile

    if args.tune_profile:
        profile = Profile.load(args.tune_profile)
    else:
        print("== measuring this machine's profile for pdserve tune", flush=True)
        profile = machine_profile(args.model, args.tune_quick)
        profile.save(work / "profile.json")
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    rate, seed = args.rates[-1], args.seed + len(args.rates) - 1  # the sweep's last point
    systems = {}
    for variant in args.variants:
        specs = loads[variant].sample(num_requests(args, rate), seed)
        out = work / f"tune-{variant}"
        d, written = tune_pick(profile, specs, rate, seed, slo, args.tune_quick, out, args.model)
        config = {**NODE_CONFIG, **tomllib.loads(written.read_text())}
        systems[variant] = PdserveSystem(
            f"{TUNED}-{variant}", d.prefill, d.decode, d.colocated, config
        )
        print(f"== tuned for {variant}: {d.label} ({written})", flush=True)
    return systems


def servers(name: str, args: argparse.Namespace, work: Path, tuned: dict) -> list[tuple]:
    """(workloads, a function that makes the server) to run for one system: the tuned one has a
    server per workload. Each server takes its port when made, just before it starts."""
    if name in PEER_SYSTEMS:
        peer = NODE_CONFIG["max_num_seqs"], args.peer_venv
        return [(args.variants, lambda: VllmServer(work, args.model, *peer))]
    if name == TUNED:
        return [
            ([v], lambda v=v: PdserveServer(tuned[v], work, model=args.model))
            for v in args.variants
        ]
    system = dataclasses.replace(SYSTEMS[name], config={**NODE_CONFIG, **SYSTEMS[name].config})
    return [(args.variants, lambda: PdserveServer(system, work, model=args.model))]


async def compare(args: argparse.Namespace, work_dir: Path, tuned: dict) -> list[dict]:
    """Every system's sweeps, round by round; `tuned`: the tuned system's configuration per
    workload (`tuned_systems`, measured before: its profile runs a server of its own)."""
    loads = workloads(args)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    warmup = SyntheticWorkload(short_prompt_len=(16, 16), short_output_len=(8, 8)).sample(
        4, args.seed + 1_000_003
    )
    sweeps = []
    # The competing load (if any) from the first server's start to the last one's end; not
    # while the tuner's profile is measured.
    with CompetingLoad(args.competing_load):
        for rnd, order in enumerate(round_order(args.systems, args.rounds), 1):
            for name in order:
                started = time.monotonic()
                for variants, make in servers(name, args, work_dir, tuned):
                    with make() as server:
                        print(f"== round {rnd}, {name}: {' '.join(server.command)}", flush=True)
                        for variant in variants:
                            sweeps.append(
                                await sweep_one(
                                    args, server, name, variant, loads, slo, warmup, rnd
                                )
                            )
                elapsed = time.monotonic() - started
                print(f"== round {rnd}, {name} done in {elapsed:.0f} s", flush=True)
    return sweeps


async def sweep_one(args, server, name, variant, loads, slo, warmup, rnd) -> dict:  # noqa: ANN001
    """One system's sweep of one workload, on a server already up."""
    # logprobs: every token in its own chunk, even one that is not yet a whole character.
    cfg = LoadConfig(
        server.base_url, seed=args.seed, progress=not args.no_progress, extra_body={"logprobs": 0}
    )
    workload = loads[variant]
    samples = Path(args.work_dir) / "cpu_samples"

    def cpu(rate: float) -> CPUUse:
        label = f"r{rnd}-{name}-{variant}-{rate:g}"
        return CPUUse(server.proc.pid, samples, args.cpu_samples_hz, label)

    handoffs_before = handoff_histogram(server)
    sweep = await run_sweep(
        lambda seed, rate, w=workload: w.sample(num_requests(args, rate), seed),
        args.rates,
        cfg,
        slo,
        label=f"{name} ({variant}), round {rnd}",
        warmup_specs=warmup,
        system=name,
        variant=variant,
        cpu=cpu,
    )
    sweep["round"] = rnd
    sweep["command"] = server.command
    sweep["kv_handoff"] = handoff_delta(handoffs_before, handoff_histogram(server))
    if name == TUNED:
        sweep["config"] = server.system.config
    return sweep


def handoff_histogram(server: object) -> tuple[float, float] | None:
    """(sum of seconds, count) of the coordinator's pdserve_kv_handoff_seconds: from a first
    token's arrival at the coordinator (its admission, without streaming) to the decode node's
    first token; None for a server without it."""
    import urllib.request

    if not isinstance(server, PdserveServer):
        return None
    try:
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        for name in ("sum", "count"):
            if line.startswith(f"pdserve_kv_handoff_seconds_{name} "):
                values[name] = float(line.split()[1])
    return (values["sum"], values["count"]) if len(values) == 2 else None


def handoff_delta(before: tuple | None, after: tuple | None) -> dict | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    count = after[1] - before[1]
    return {"count": int(count), "mean_ms": (after[0] - before[0]) / count * 1e3}


def compact(results: dict) -> dict:
    """The results without each request's inter-token gaps (their distribution is in every
    summary) and with times to the microsecond, so the file stays small enough to keep."""
    for sweep in results["sweeps"]:
        for point in sweep["points"]:
            for request in point["requests"]:
                request.pop("itl", None)

    def rounded(x: object) -> object:
        if isinstance(x, float):
            return round(x, 6)
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rounded(v) for v in x]
        return x

    return rounded(results)  # type: ignore[return-value]


def settings_line(results: dict) -> str:
    """The run's SLO and request counts, as the docs print them above its tables."""
    return (
        f"{served_rounds.slo_line(results)} {results['elapsed_s'] / 60:.1f} min in all. "
        "Every token streamed in its own chunk (`logprobs: 0`)."
    )


def docs_table(results: dict) -> str:
    """The docs' results table: a row per system, workload and rate."""
    return settings_line(results) + "\n\n" + results_table(results["sweeps"])


def docs_interference(results: dict) -> str:
    """The docs' table of the short requests' P99 TPOT, mixed against short-only."""
    sweeps = results["sweeps"]
    return interference_table(sweeps, list(dict.fromkeys(s["system"] for s in sweeps)))


def docs_aims(results: dict) -> str:
    """The issue's aims as measured ratios, a line each."""
    sweeps = results["sweeps"]
    static = "colocated-static" if any(s["system"] == "colocated-static" for s in sweeps) else None
    limits = results["settings"].get("latency_limits_ms", [1000.0, 2000.0, 3000.0])
    return "\n".join(aims(sweeps, "disaggregated", "colocated", static, limits))


def docs_long_requests(results: dict) -> str:
    """The docs' table of the long requests (layer-wise KV streaming off and on)."""
    return long_requests_table(results["sweeps"])


def _point(results: dict, system: str, variant: str, rate: float) -> dict | None:
    for sweep in results["sweeps"]:
        if sweep["system"] == system and sweep["variant"] == variant:
            for point in sweep["points"]:
                if point["config"]["rate"] == rate:
                    return point["summary"]
    return None


def docs_handoff(
    results: dict, before: str = "disaggregated-between-steps", after: str = "disaggregated"
) -> str:
    """The docs' table of the KV handoff between steps (`before`) and beside them (`after`):
    per workload, rate and kind of request, the gap from first to second token and P99 TPOT."""
    rows = [
        "| workload | rate (req/s) | kind | first-to-second token P50 / P99 (ms), between steps "
        "| immediate | P99 TPOT (ms), between steps | immediate |",
        "| --- | ---: | --- | --- | --- | ---: | ---: |",
    ]
    for sweep in results["sweeps"]:
        if sweep["system"] != before:
            continue
        for point in sweep["points"]:
            rate = point["config"]["rate"]
            other = _point(results, after, sweep["variant"], rate)
            for kind in ("short", "long"):
                a = point["summary"]["by_kind"].get(kind)
                b = (other or {}).get("by_kind", {}).get(kind)
                if not a or not b or not a["count"]:
                    continue
                gap = lambda k: f"{k['first_itl_ms']['p50']:.1f} / {k['first_itl_ms']['p99']:.1f}"  # noqa: E731
                rows.append(
                    f"| {sweep['variant']} | {rate:g} | {kind} | {gap(a)} | {gap(b)} "
                    f"| {a['tpot_ms']['p99']:.1f} | {b['tpot_ms']['p99']:.1f} |"
                )
    return "\n".join(rows)


def docs_handoff_all(
    results: dict, before: str = "disaggregated-between-steps", after: str = "disaggregated"
) -> str:
    """All requests of the mixed workload, `before` → `after` at each rate: P99 TPOT, SLO
    attainment, P99 TTFT; and the short requests' P99 TPOT, mixed over short-only."""
    rates = [p["config"]["rate"] for s in results["sweeps"] if s["system"] == before
             for p in s["points"] if s["variant"] == "mixed"]  # fmt: skip
    lines = []
    for rate in rates:
        a, b = _point(results, before, "mixed", rate), _point(results, after, "mixed", rate)
        if a is None or b is None:
            continue
        ratios = []
        for system in (before, after):
            mixed = _point(results, system, "mixed", rate)
            short = _point(results, system, "short-only", rate)
            if mixed and short:
                m, s = (x["by_kind"]["short"]["tpot_ms"]["p99"] for x in (mixed, short))
                ratios.append(f"{m / s:.2f}x")
        lines.append(
            f"- {rate:g} req/s, mixed, all requests, between steps → immediate: P99 TPOT "
            f"{a['tpot_ms']['p99']:.1f} → {b['tpot_ms']['p99']:.1f} ms; SLO attainment "
            f"{a['slo_attainment']:.0%} → {b['slo_attainment']:.0%}; P99 TTFT "
            f"{a['ttft_ms']['p99']:.0f} → {b['ttft_ms']['p99']:.0f} ms; short requests' P99 "
            f"TPOT over short-only {' → '.join(ratios)}"
        )
    return "\n".join(lines)


def docs_goodput_runs(first: dict, second: dict) -> str:
    """Goodput of two runs of the same sweep side by side, per system, workload and rate."""
    rows = [
        "| system | workload | rate (req/s) | goodput, earlier run (req/s) | goodput, run shown "
        "(req/s) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for sweep in second["sweeps"]:
        for point in sweep["points"]:
            rate = point["config"]["rate"]
            earlier = _point(first, sweep["system"], sweep["variant"], rate)
            e = f"{earlier['goodput']:.2f}" if earlier else "n/a"
            rows.append(
                f"| {sweep['system']} | {sweep['variant']} | {rate:g} | {e} "
                f"| {point['summary']['goodput']:.2f} |"
            )
    return "\n".join(rows)


def docs_streaming(
    *results: dict,
    off: str = "disaggregated-no-streaming",
    on: str = "disaggregated-streaming",
) -> str:
    """The docs' table of layer-wise KV streaming off and on, a row per results file and rate:
    the long requests' TTFT and gap from first to second token, and the coordinator's mean time
    from a first token to the decode node's first over the sweep (every request's, which in a
    workload with short requests is mostly theirs)."""
    rows = [
        "| workload | long requests | TTFT P50 / P99 (ms), off | on | first-to-second token "
        "P50 / P99 (ms), off | on | first token to decode start, mean (ms), off | on |",
        "| --- | ---: | --- | --- | --- | --- | ---: | ---: |",
    ]
    for r in results:
        sweeps = {s["system"]: s for s in r["sweeps"]}
        if off not in sweeps or on not in sweeps:
            continue
        variant = sweeps[off]["variant"]
        for point in sweeps[off]["points"]:
            rate = point["config"]["rate"]
            a = point["summary"]["by_kind"]["long"]
            b = (_point(r, on, variant, rate) or {}).get("by_kind", {}).get("long")
            if not b:
                continue
            pair = lambda k, m: f"{k[m]['p50']:.0f} / {k[m]['p99']:.0f}"  # noqa: E731
            gap = lambda k: f"{k['first_itl_ms']['p50']:.1f} / {k['first_itl_ms']['p99']:.1f}"  # noqa: E731
            scope = "" if variant == "long-only" else " (all requests)"
            handoff = [sweeps[x].get("kv_handoff") for x in (off, on)]
            start = [f"{h['mean_ms']:.1f}{scope}" if h else "n/a" for h in handoff]
            rows.append(
                f"| {variant}, {rate:g} req/s | {a['count']} | {pair(a, 'ttft_ms')} "
                f"| {pair(b, 'ttft_ms')} | {gap(a)} | {gap(b)} | {start[0]} | {start[1]} |"
            )
    return "\n".join(rows)


def markdown(results: dict) -> str:
    """Everything the run shows, as the docs render it."""
    if results["settings"].get("rounds", 1) > 1:
        return served_rounds.markdown(results)
    parts = [docs_table(results), docs_interference(results), docs_aims(results)]
    if any(s["system"].endswith("streaming") for s in results["sweeps"]):
        parts.append(docs_long_requests(results))
    # A table with no rows (no pair of workloads to compare) is left out.
    return "\n\n".join(p for p in parts if p and p.count("\n") != 1)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


PROG = "pdserve.bench.compare"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.compare", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--systems",
        nargs="+",
        choices=[*SYSTEMS, TUNED, *PEER_SYSTEMS],
        default=DEFAULT_SYSTEMS,
        metavar="SYSTEM",
        help=f"systems to run, of {', '.join([*SYSTEMS, TUNED, *PEER_SYSTEMS])} (tuned: what "
        "`pdserve tune` picks for two workers here, per workload, at the highest rate; vllm: "
        "vLLM's OpenAI server on its CPU backend, from `make bench-peers`)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times every system runs, in the given order in odd rounds and reversed in even "
        "ones (default: 1)",
    )
    p.add_argument(
        "--competing-load",
        type=int,
        default=0,
        help="processes that each keep a core busy while the systems serve, as other work on "
        "a shared host does (default: 0)",
    )
    p.add_argument(
        "--cpu-samples-hz",
        type=int,
        default=0,
        help="sample every process of each system with py-spy at this rate for the split of "
        "its CPU by kind of work (raw samples in the work directory's cpu_samples/); default 0: "
        "each process's CPU time only",
    )
    p.add_argument(
        "--tune-profile",
        default=None,
        help="the profile `pdserve tune` searches with, for --systems tuned (default: unset, "
        "measured on this machine first)",
    )
    p.add_argument(
        "--tune-quick",
        action="store_true",
        help="a few profile points and a small search for tuned: checks the command itself",
    )
    p.add_argument(
        "--peer-venv", type=Path, default=VLLM_VENV, help="vLLM's virtualenv, for --systems vllm"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=DEFAULT_VARIANTS,
        help="workloads each system runs: mixed (long prompts among short ones), "
        "short-only, long-only",
    )
    p.add_argument(
        "--rates",
        type=floats,
        default=[2.0, 4.0, 6.0, 8.0, 10.0],
        help="request rates of the sweep, req/s",
    )
    p.add_argument("--duration-s", type=float, default=20.0, help="of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=60, help="per rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads and arrivals")
    p.add_argument(
        "--short-prompt-len",
        type=length_range,
        default=(16, 64),
        help="short prompts' tokens, N or LO:HI",
    )
    p.add_argument(
        "--short-output-len",
        type=length_range,
        default=(32, 96),
        help="short requests' output tokens, N or LO:HI",
    )
    p.add_argument(
        "--long-fraction",
        type=float,
        default=0.15,
        help="share of long prompts in the mixed workload",
    )
    p.add_argument(
        "--long-prompt-len",
        type=length_range,
        default=(1536, 1900),
        help="long prompts' tokens, N or LO:HI",
    )
    p.add_argument(
        "--long-output-len",
        type=length_range,
        default=(8, 16),
        help="long prompts' output tokens, N or LO:HI",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT objective of goodput")
    p.add_argument("--slo-tpot-ms", type=float, default=25.0, help="TPOT objective of goodput")
    p.add_argument(
        "--latency-limits-ms",
        type=floats,
        default=[1000.0, 2000.0, 3000.0],
        help="P99 end-to-end latencies at which continuous and static are compared",
    )
    p.add_argument(
        "--model",
        default="pdserve-bench",
        help="checkpoint directory, pdserve-tiny, or pdserve-bench (generated)",
    )
    p.add_argument(
        "--results", default=None, help="results JSON (default: WORK_DIR/serving_compare.json)"
    )
    p.add_argument("--plot", default=None, help="figure (default: WORK_DIR/serving_sweep.png)")
    p.add_argument(
        "--write-docs",
        action="store_true",
        help="write the results to bench/results/serving_compare.json and the figure to "
        "docs/serving_sweep.png (unless --results or --plot say otherwise), and render "
        "docs/benchmarks.md again from its results files",
    )
    p.add_argument("--no-doc", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument(
        "--work-dir",
        default=None,
        help="configs, logs and results (default: a new temporary directory)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def outputs(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path | None]:
    """Where the results JSON and the figure go, and the doc rendered again from the results
    files: the paths given, else the work directory and no doc; with --write-docs, the
    repository's files (the doc's blocks read bench/results/serving_compare.json)."""
    if args.write_docs:
        results, plot, doc = REPO_ROOT / RESULTS, REPO_ROOT / PLOT, REPO_ROOT / DOC
    else:
        results, plot, doc = work / "serving_compare.json", work / "serving_sweep.png", None
    return Path(args.results or results), Path(args.plot or plot), doc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "vllm" in args.systems and (why := missing_peer("vllm", args.peer_venv)):
        raise SystemExit(f"pdserve.bench.compare: error: {why}")
    started = time.monotonic()
    record = provenance.start(sys.argv if argv is None else ["python", "-m", PROG, *argv])
    settings = dict(vars(args))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    print(f"configs, logs and results in {work}", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    args.work_dir = str(work)
    results_path, plot_path, doc = outputs(args, work)
    args.results, args.plot = str(results_path), str(plot_path)
    if args.model == BENCH_NAME:
        args.model = str(ensure_bench_model())
    tuned = tuned_systems(args, work, workloads(args)) if TUNED in args.systems else {}
    sweeps = asyncio.run(compare(args, work, tuned))
    results = provenance.finish(record) | {
        "settings": settings,
        "model": args.model,
        "sweeps": sweeps,
        "elapsed_s": time.monotonic() - started,
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(compact(results), default=str))
    title = (
        f"pdserve on {results['machine']['cores']} CPU cores: mixed workload (solid) "
        f"and short-only (dashed)"
    )
    plot_sweeps(results["sweeps"], args.plot, title)
    print(markdown(json.loads(Path(args.results).read_text())))
    if doc is not None:
        docs.main([str(doc.relative_to(REPO_ROOT))])
    print(f"wrote {args.results}, {args.plot}" + (f", {doc}" if doc else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
