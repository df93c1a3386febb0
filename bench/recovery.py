"""Recovery time after a SIGKILL, on a real local cluster: from the SIGKILL of a decode node, a
prefill node, the coordinator (under `pdserve launch`, which restarts it) or rank 1 of a
tensor-parallel node, to the first token that each request in flight on it is served afterwards.

    python -m pdserve.bench.recovery                             # the four kills, 5 of each
    python -m pdserve.bench.recovery --kinds decode --repeats 1 --model pdserve-tiny
    python -m pdserve.bench.recovery --repeats 5 --out bench/results/recovery.json

Node kills (decode, prefill, tp-rank) run the coordinator in this process on its defaults, with
every node a real process started as `pdserve serve` starts them, so the coordinator's own records
say which requests a kill moved: a request is affected when its attempt number grew, and its
recovery is the time from the kill to the client's receipt of the first token of its new attempt
(tokens the node sent before it died and that arrive late do not count). The coordinator kill runs
`pdserve launch` on a generated cluster file and streams over HTTP: every stream in flight is
affected. The kill cuts its connection, and the client resubmits prompt + the tokens it got,
retrying while nothing serves, as any client of a restarted coordinator must (the new one knows
nothing of the old one's requests); its recovery is the time from the kill to the first token of
that resubmission. Each kill waits until the coordinator has run the supervisor's stable_s, so
that every kill meets the first step of the restart backoff.

Every request, affected or not, must end with the offline engine's tokens (greedy). The command
exits 1 when a request failed or differs, when a kind misses its aim (2 s for a node, 5 s for the
coordinator; --no-aim-check leaves that out), when a kind has no affected request to measure, or
when a process it started is still running at the end; each is said in its output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.process_tree import Sessions
from pdserve.bench.recovery_coordinator import coordinator_kills, supervisor_defaults
from pdserve.bench.recovery_nodes import node_kills
from pdserve.bench.recovery_record import (
    AIM_S,
    KINDS,
    LABELS,
    Kill,
    KindSummary,
    Workload,
    summarize,
)
from pdserve.cluster.node_options import NodeOptions
from pdserve.cluster.schema import defaults
from pdserve.coordinator import coordinator as coordinator_module
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.embedded_models import default_model

# --- the settings that bound the figures -------------------------------------------------------


def bounding_settings() -> dict[str, float]:
    """Every setting that bounds a recovery, read from where pdserve keeps it."""
    config = CoordinatorConfig()
    supervisor = supervisor_defaults()
    backoff_min, backoff_max = supervisor["backoff_s"]
    return {
        "heartbeat_interval_s": defaults(NodeOptions)["heartbeat_interval_s"],
        "heartbeat_timeout_s": config.heartbeat_timeout_s,
        "disconnect_grace_s": config.disconnect_grace_s,
        "coordinator_tick_s": coordinator_module.TICK_S,
        "transfer_timeout_s": config.transfer_timeout_s,
        "kv_streaming_timeout_s": config.kv_streaming_timeout_s,
        "max_retries": config.max_retries,
        "supervisor_restart_delay_s": backoff_min,
        "supervisor_restart_delay_max_s": backoff_max,
        "supervisor_stable_s": supervisor["stable_s"],
        "supervisor_quick_death_s": supervisor["quick_death_s"],
    }


def render(summaries: list[KindSummary], aim_check: bool) -> str:
    def s(v: float | None) -> str:
        return "not measured" if v is None else f"{v:.2f}"

    lines = [
        "| kill | kills | affected requests | P50 (s) | max (s) | failed | aim | met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for k in summaries:
        met = "not measured" if not k.measured else ("yes" if k.aim_met else "no")
        lines.append(
            f"| {LABELS[k.kind]} | {k.kills} | {k.affected} | {s(k.p50_s)} | {s(k.max_s)} | "
            f"{len(k.failed)} | < {k.aim_s:g} s | {met if aim_check else met + ' (unchecked)'} |"
        )
    return "\n".join(lines)


def verdict(summaries: list[KindSummary], strays: list, aim_check: bool) -> list[str]:
    """Why the run fails; empty when it passes."""
    problems = []
    for k in summaries:
        problems += [f"{k.kind}: failed: {f}" for f in k.failed]
        if not k.measured:
            problems.append(f"{k.kind}: not measured (no affected request recovered)")
        elif aim_check and not k.aim_met:
            problems.append(f"{k.kind}: aim missed: max {k.max_s:.2f} s, aim < {k.aim_s:g} s")
    problems += [f"process left running: {pid} {cmd}" for pid, cmd in strays]
    return problems


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.recovery",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="kills")
    parser.add_argument("--repeats", type=int, default=5, help="kills of each kind")
    parser.add_argument("--requests", type=int, default=8, help="streams in flight at each kill")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of each stream")
    parser.add_argument("--model", default=default_model(), help="pdserve-stories, pdserve-tiny…")
    parser.add_argument("--transport", default="tcp", choices=("tcp", "shm"), help="KV transport")
    parser.add_argument("--kv-cache-bytes", type=int, default=128 << 20, help="each node's KV pool")
    parser.add_argument(
        "--timeout-s", type=float, default=120.0, help="longest wait for a kill's requests"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the prompts")
    parser.add_argument(
        "--log-dir",
        help="keep the node and launch logs here (None: a temporary directory, removed)",
    )
    parser.add_argument("--out", help="write the results file here (None: none written)")
    parser.add_argument(
        "--no-aim-check",
        dest="aim_check",
        action="store_false",
        help="exit 0 even when a kind misses its aim (failures still count)",
    )
    return parser


def run(args: argparse.Namespace, argv: list[str]) -> tuple[dict, list[KindSummary], list[str]]:
    """Every kill of every kind asked for; the results file's content, the summaries and the
    problems (empty: passed)."""
    settings = bounding_settings()
    print("settings that bound a recovery:", settings, flush=True)
    engine = EngineConfig(
        model=args.model,
        device="cpu",
        kv_cache_bytes=args.kv_cache_bytes,
    )
    workload = Workload(args.model, args.requests, args.max_tokens, args.seed)
    sessions = Sessions()
    before = uptime()
    print(f"load before: {before}", flush=True)
    started = dt.datetime.now(dt.UTC)
    kills: dict[str, list[Kill]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-recovery-") as tmp:
        logs = Path(args.log_dir) if args.log_dir else Path(tmp)
        for kind in args.kinds:
            print(f"--- {kind}", flush=True)
            try:
                if kind == "coordinator":
                    work = logs / "coordinator"
                    work.mkdir(parents=True, exist_ok=True)
                    kills[kind] = coordinator_kills(
                        args.repeats,
                        workload,
                        engine,
                        sessions,
                        work,
                        args.timeout_s,
                        args.transport,
                    )
                else:
                    kills[kind] = node_kills(
                        kind,
                        args.repeats,
                        workload,
                        engine,
                        sessions,
                        logs,
                        args.timeout_s,
                        args.transport,
                    )
            except Exception as exc:  # reported as this kind's failure; the others go on
                print(f"{kind}: not measured: {exc}", flush=True)
                kills[kind] = [Kill(kind, 0, "", [], error=f"{type(exc).__name__}: {exc}")]
        strays = sessions.strays()
        sessions.kill_strays(strays)
    after = uptime()
    print(f"load after: {after}", flush=True)
    summaries = [summarize(kind, kills[kind]) for kind in args.kinds]
    problems = verdict(summaries, strays, args.aim_check)
    from pdserve.bench.compare import git, machine

    dirty = git("status", "--porcelain", "--untracked-files=no")
    result = {
        "command": " ".join(["python -m pdserve.bench.recovery", *argv]),
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_files": len(dirty.splitlines()),
        "date": started.isoformat(timespec="seconds"),
        "machine": machine() | {"uptime_before": before, "uptime_after": after},
        "model": args.model,
        "engine": {"kv_cache_bytes": args.kv_cache_bytes, "block_size": engine.block_size},
        "workload": {
            "requests_per_kill": args.requests,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "transport": args.transport,
        },
        "settings": settings,
        "aims_s": {k: AIM_S[k] for k in args.kinds},
        "summary": [asdict(s) for s in summaries],
        "kills": [k.summary() for kind in args.kinds for k in kills[kind]],
        "strays": strays,
        "problems": problems,
    }
    return result, summaries, problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    result, summaries, problems = run(args, argv)
    print(render(summaries, args.aim_check))
    for k in summaries:
        stages = ", ".join(f"{name} {v:.2f}" for name, v in k.stages_p50_s.items())
        print(f"{k.kind}: P50 of the stages (s after the kill): {stages or 'none'}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"results: {args.out}")
    for problem in problems:
        print(f"FAIL {problem}")
    print("PASS" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
