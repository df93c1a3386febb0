"""The tuner's predictions beside real runs: profiles this machine (`pdserve tune profile`), predicts
three configurations (1 prefill + 1 decode, 2 colocated, and the one `pdserve tune` picks for two
workers here) at three rates on the serving benchmark's workload, runs the same requests at the
same arrival times against `pdserve serve` with `pdserve.bench.serve_load`'s load generator, and prints
each prediction beside its measurement.

    .venv/bin/python -m pdserve.bench.tune_validate                    # ~5 min on 2 cores
    .venv/bin/python -m pdserve.bench.tune_validate --rates 2 --duration-s 3 --min-requests 6 --quick

The last lines: `tune validation: goodput error max X%, TTFT p50 error max Y%, TPOT p50 error max
Z%, ranking same|different|tied` and the verdict. Errors are |predicted - measured| / measured; the
ranking orders the configurations by their goodput summed over the rates, predicted and measured,
and only pairs whose predicted totals differ by more than the aim are ranked (closer ones are a
tie the prediction does not decide). The table's last column is the CPU the machine's other
processes took during each measurement, in cores: the simulator models the deployment alone, so
on a shared machine that is load it cannot foresee.

Exit status: 0 when every error is within `--aim` (20 %) and every ranked pair is in the measured
order; 1 when an error exceeds the aim or a ranked pair is reversed; 3 when other processes took
more than `--max-other-cores` (0.25) during a measurement, so the comparison says nothing (the
verdict is refused, the figures still printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.serving.bench_model import ensure_bench_model
from pdserve.bench.serving.cpu_use import CPUUse
from pdserve.tune import provenance
from pdserve.tune.arrivals import arrival_offsets
from pdserve.tune.deployment import Deployment
from pdserve.tune.load_generator import LoadConfig, run_load
from pdserve.tune.local_server import PdserveServer, PdserveSystem
from pdserve.tune.measure import StepGrid, measure_frontend, measure_profile
from pdserve.tune.metrics import summarize
from pdserve.tune.profile import Profile
from pdserve.tune.report import write_outputs
from pdserve.tune.search import SearchSpace, search
from pdserve.tune.serving_workload import RequestSpec, SyntheticWorkload
from pdserve.tune.simulator import Simulation
from pdserve.tune.slo import SLO
from pdserve.tune.transfer_model import TransferModel
from pdserve.tune.workload import SimRequest, from_requests

# The serving benchmark's node settings (bench/compare.py), on every configuration.
NUM_KV_BLOCKS = 2048
BASE = Deployment(1, 1, max_num_batched_tokens=2048, max_num_seqs=256)


@dataclass(slots=True)
class Point:
    system: str
    rate: float
    predicted: dict
    measured: dict

    def error(self, key: str) -> float:
        p, m = self.value(self.predicted, key), self.value(self.measured, key)
        return abs(p - m) / m if m else (0.0 if p == m else float("inf"))

    @staticmethod
    def value(summary: dict, key: str) -> float:
        value = summary
        for part in key.split("."):
            value = value[part]
        return float(value)


def workload(args: argparse.Namespace) -> SyntheticWorkload:
    return SyntheticWorkload(
        short_prompt_len=(16, 64),
        short_output_len=(32, 96),
        long_fraction=args.long_fraction,
        long_prompt_len=(1536, 1900),
        long_output_len=(8, 16),
    )


def requests_at(args: argparse.Namespace, rate: float, seed: int) -> list[RequestSpec]:
    return workload(args).sample(max(args.min_requests, round(rate * args.duration_s)), seed)


def sim_requests(specs: list[RequestSpec], rate: float, seed: int) -> list[SimRequest]:
    """The same requests at the same arrival times as the load generator sends them."""
    offsets = arrival_offsets(len(specs), rate, 1.0, seed)
    return [
        SimRequest(float(t), s.prompt_len, s.output_len, tuple(s.prompt))
        for s, t in zip(specs, offsets)
    ]


def machine_profile(model: str, quick: bool, transfer: TransferModel | None = None) -> Profile:
    """This machine's profile as the serving benchmarks' nodes run: one torch thread each
    (SINGLE_THREAD_ENV), the benchmarks' KV pool; with the front end's per-step overhead unless
    quick."""
    profile = measure_profile(
        model,
        device="cpu",
        threads=1,
        grid=StepGrid.quick() if quick else StepGrid(),
        kv_blocks=NUM_KV_BLOCKS,
        transfer=transfer,
    )
    return profile if quick else measure_frontend(profile, model)


def tune_pick(
    profile: Profile,
    specs: list[RequestSpec],
    rate: float,
    seed: int,
    slo: SLO,
    quick: bool,
    out_dir: Path,
    model: str,
) -> tuple[Deployment, Path]:
    """What `pdserve tune` picks for two workers on these requests at this rate (arriving as
    the load generator sends them), and the coordinator config it writes for the pick (in
    out_dir)."""
    space = SearchSpace.quick() if quick else SearchSpace()
    requests = from_requests(sim_requests(specs, rate, seed), "the serving benchmark's")
    found = search(profile, requests, slo, 2, space=space, base=BASE, processes=1)
    # The pick runs from the config pdserve tune writes, as it is.
    return found.best.deployment, write_outputs(found.best, profile, slo, 2, out_dir, model, 8)[0]


def system_for(name: str, d: Deployment) -> PdserveSystem:
    config = {"num_kv_blocks": NUM_KV_BLOCKS, **d.engine_settings(), **d.coordinator_settings()}
    return PdserveSystem(name, d.prefill, d.decode, d.colocated, config)


def predict(profile: Profile, d: Deployment, requests: list[SimRequest], slo: SLO, rate: float):
    result = Simulation(d, profile).run(requests)
    return summarize(result.outcomes, slo, rate).to_dict()


def measured_summary(summary: dict, other_cores: float | None) -> dict:
    return {
        "goodput": summary["goodput"],
        "attainment": summary["slo_attainment"],
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "completed": summary["completed"],
        "duration_s": summary["duration_s"],
        "other_cores": other_cores,
    }


async def measure(
    name: str,
    d: Deployment,
    args: argparse.Namespace,
    work: Path,
    model: str,
    config: dict | None = None,
) -> dict[float, dict]:
    """Run the rates against `pdserve serve` with `config` (default: the deployment's settings)."""
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    warmup = SyntheticWorkload(short_prompt_len=(16, 16), short_output_len=(8, 8)).sample(
        4, args.seed + 1_000_003
    )
    out = {}
    system = system_for(name, d)
    if config is not None:
        system.config = config
    with PdserveServer(system, work, model=model) as server:
        cfg = LoadConfig(
            server.base_url, seed=args.seed, progress=False, extra_body={"logprobs": 0}
        )
        for i, rate in enumerate(args.rates):
            cfg.rate, cfg.seed = rate, args.seed + i
            specs = requests_at(args, rate, args.seed + i)
            # The CPU the machine's other processes took meanwhile: the simulator models the
            # deployment alone, so on a shared machine that is load it cannot foresee.
            watch = CPUUse(server.proc.pid, work)
            watch.begin()
            run = await run_load(specs, cfg, slo, warmup if i == 0 else ())
            other = watch.end(run["summary"]["output_tokens"])["others_cores"]
            out[rate] = measured_summary(run["summary"], other)
    return out


ERRORS = ("goodput", "ttft_ms.p50", "tpot_ms.p50")
PASSED, MISSED, REFUSED = 0, 1, 3


def totals(points: list[Point], which: str) -> dict[str, float]:
    """Each configuration's goodput summed over the rates, predicted or measured."""
    out: dict[str, float] = {}
    for p in points:
        out[p.system] = out.get(p.system, 0.0) + getattr(p, which)["goodput"]
    return out


def ranking(points: list[Point], which: str) -> list[str]:
    summed = totals(points, which)
    return sorted(summed, key=lambda s: -summed[s])


def reversed_pairs(points: list[Point], aim: float) -> tuple[list[tuple[str, str]], int]:
    """Pairs of configurations the prediction ranks (predicted totals more than `aim` apart)
    that the measurements order the other way, and how many pairs were ranked."""
    predicted, measured = totals(points, "predicted"), totals(points, "measured")
    names = sorted(predicted)
    wrong, ranked = [], 0
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            high, low = (a, b) if predicted[a] >= predicted[b] else (b, a)
            if predicted[high] - predicted[low] <= aim * max(predicted[high], 1e-12):
                continue  # a tie within the prediction's error: not ranked
            ranked += 1
            if measured[low] > measured[high]:
                wrong.append((high, low))
    return wrong, ranked


def verdict(points: list[Point], aim: float, max_other_cores: float) -> tuple[int, str]:
    """(exit status, the line that says why): refused when other load spoiled a measurement,
    missed when an error exceeds the aim or a ranked pair is reversed, else passed."""
    loaded = [
        p
        for p in points
        if p.measured.get("other_cores") is not None and p.measured["other_cores"] > max_other_cores
    ]
    if loaded:
        worst = max(loaded, key=lambda p: p.measured["other_cores"])
        return REFUSED, (
            f"verdict refused: other processes took {worst.measured['other_cores']:.2f} cores "
            f"while {worst.system} @ {worst.rate:g} req/s was measured (at most "
            f"{max_other_cores:g} for a fair comparison)"
        )
    misses = [
        f"{p.system} @ {p.rate:g} {key} {p.error(key):.0%}"
        for p in points
        for key in ERRORS
        if p.error(key) > aim
    ]
    wrong, _ = reversed_pairs(points, aim)
    misses += [f"{high} predicted above {low}, measured below" for high, low in wrong]
    if misses:
        return MISSED, f"verdict: aim of {aim:.0%} missed: " + "; ".join(misses)
    return PASSED, f"verdict: every error within {aim:.0%} and the ranking holds"


def points_of(results: dict) -> list[Point]:
    """The points a results file holds."""
    return [Point(p["system"], p["rate"], p["predicted"], p["measured"]) for p in results["points"]]


def docs_table(results: dict) -> str:
    """Each prediction beside its measurement, from a results file (`--json`); the command
    prints the same."""
    rows = [
        "| configuration | rate (req/s) | goodput predicted / measured (req/s) | error "
        "| TTFT p50 predicted / measured (ms) | error | TPOT p50 predicted / measured (ms) "
        "| error | SLO met predicted / measured | other processes' CPU (cores) |",
        "|" + " --- |" * 10,
    ]
    for p in points_of(results):
        pr, me = p.predicted, p.measured
        rows.append(
            f"| {p.system} | {p.rate:g} | {pr['goodput']:.2f} / {me['goodput']:.2f} "
            f"| {p.error('goodput'):.0%} "
            f"| {pr['ttft_ms']['p50']:.1f} / {me['ttft_ms']['p50']:.1f} "
            f"| {p.error('ttft_ms.p50'):.0%} "
            f"| {pr['tpot_ms']['p50']:.2f} / {me['tpot_ms']['p50']:.2f} "
            f"| {p.error('tpot_ms.p50'):.0%} "
            f"| {pr['attainment']:.0%} / {me['attainment']:.0%} "
            f"| {'-' if me.get('other_cores') is None else format(me['other_cores'], '.2f')} |"
        )
    return "\n".join(rows)


def summary_line(results: dict) -> str:
    """The worst error of each kind and whether the ranking held."""
    points = points_of(results)
    wrong, ranked = reversed_pairs(points, results["aim"])
    order = "tied" if not ranked else "different" if wrong else "same"
    worst = {k: max(p.error(k) for p in points) for k in ERRORS}
    return (
        f"tune validation: goodput error max {worst['goodput']:.0%}, TTFT p50 error max "
        f"{worst['ttft_ms.p50']:.0%}, TPOT p50 error max {worst['tpot_ms.p50']:.0%}, "
        f"ranking {order}"
    )


def docs_summary(results: dict) -> str:
    """The run's summary and verdict lines, as the command prints them last."""
    return f"`{summary_line(results)}`\n\n`{results['verdict']['line']}`"


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.tune_validate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rates", type=lambda t: [float(x) for x in t.split(",")], default=[2.0, 5.0, 8.0]
    )
    p.add_argument("--duration-s", type=float, default=20.0, help="of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=60, help="per rate")
    p.add_argument("--long-fraction", type=float, default=0.15)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model", default=None, help="checkpoint (default: pdserve-bench, the serving benchmark's)"
    )
    p.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few profile points and a small search: checks the command itself",
    )
    p.add_argument(
        "--transfer-gbps",
        type=float,
        default=None,
        help="state the KV transfer's bandwidth instead of measuring it",
    )
    p.add_argument("--transfer-latency-ms", type=float, default=1.0)
    p.add_argument("--aim", type=float, default=0.2, help="largest error that passes")
    p.add_argument(
        "--max-other-cores",
        type=float,
        default=0.25,
        help="other processes' CPU during a measurement beyond which no verdict is given",
    )
    p.add_argument(
        "--json",
        default=None,
        help="also write every figure here, with the run's provenance and its verdict "
        "(bench/results/tune_validate.json renders the docs' table)",
    )
    p.add_argument("--work-dir", default=None, help="configs and logs (default: a temp dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = provenance.start(
        sys.argv if argv is None else ["python", "-m", "pdserve.bench.tune_validate", *argv]
    )
    started = time.monotonic()
    model = args.model or str(ensure_bench_model())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-tune-validate-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs; load before: {uptime()}", flush=True)
    print(f"# model: {Path(model).name} ({model})", flush=True)
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        transfer = None
        if args.transfer_gbps is not None:
            latency = args.transfer_latency_ms / 1e3
            transfer = TransferModel(latency, args.transfer_gbps * 1e9, "tcp")
        profile = machine_profile(model, args.quick, transfer)
        profile.save(work / "profile.json")
    print(f"# profile: {profile.source}", flush=True)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    # What pdserve tune picks for two workers here, on the same workload at the middle rate.
    rate = args.rates[len(args.rates) // 2]
    specs = requests_at(args, rate, args.seed)
    picked, written = tune_pick(
        profile, specs, rate, args.seed, slo, args.quick, work / "tune", model
    )
    systems = {"1P+1D": BASE, "2 colocated": BASE.with_(prefill=0, decode=2, colocated=True)}
    name = next((n for n, d in systems.items() if d == picked), "tune's pick")
    systems[name] = picked
    print(f"# tune picks: {picked.label} ({name}); {written}", flush=True)
    points = []
    for system, d in systems.items():
        config = tomllib.loads(written.read_text()) if d == picked else None
        before = os.getloadavg()[0]
        measured = asyncio.run(measure(system, d, args, work, model, config))
        # Other jobs on the machine share its cores with the nodes: the load says how much.
        print(
            f"# {system}: 1-min load average {before:.2f} before, {os.getloadavg()[0]:.2f} after",
            flush=True,
        )
        for i, rate in enumerate(args.rates):
            requests = sim_requests(requests_at(args, rate, args.seed + i), rate, args.seed + i)
            predicted = predict(profile, d, requests, slo, rate)
            points.append(Point(system, rate, predicted, measured[rate]))
            print(
                f"{system} @ {rate:g}: predicted {predicted['goodput']:.2f}, measured "
                f"{measured[rate]['goodput']:.2f} req/s",
                flush=True,
            )
    print(f"# load after: {uptime()}; {(time.monotonic() - started) / 60:.1f} min")
    status, line = verdict(points, args.aim, args.max_other_cores)
    results = provenance.finish(record) | {
        "profile": profile.to_dict(),
        "picked": picked.label,
        "aim": args.aim,
        "max_other_cores": args.max_other_cores,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "verdict": {"status": status, "line": line},
        "points": [
            {"system": p.system, "rate": p.rate, "predicted": p.predicted, "measured": p.measured}
            for p in points
        ],
    }
    print(docs_table(results))
    print(summary_line(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(line)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
