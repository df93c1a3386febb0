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
import json
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
from pdserve.engine.embedded.catalog import default_model
from pdserve.tune import provenance

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
    """The table of every kind's recovery times."""
    return docs_table({"summary": [asdict(k) for k in summaries], "aim_check": aim_check})


def docs_table(results: dict) -> str:
    """The docs' table of a results file: per kind of kill, the affected requests' recovery
    times against the aim (`python -m pdserve.bench.docs` renders it)."""

    def s(v: float | None) -> str:
        return "not measured" if v is None else f"{v:.2f}"

    aim_check = results.get("aim_check", "--no-aim-check" not in results.get("command", ""))
    lines = [
        "| kill | kills | affected requests | P50 (s) | max (s) | failed | aim | met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for k in results["summary"]:
        measured = k["p50_s"] is not None
        met = "yes" if measured and k["max_s"] < k["aim_s"] else "no"
        met = met if measured else "not measured"
        lines.append(
            f"| {LABELS[k['kind']]} | {k['kills']} | {k['affected']} | {s(k['p50_s'])} "
            f"| {s(k['max_s'])} | {len(k['failed'])} | < {k['aim_s']:g} s "
            f"| {met if aim_check else met + ' (unchecked)'} |"
        )
    return "\n".join(lines)


def _per_kill(results: dict, kind: str) -> list[tuple[float, float, float, list[int]]]:
    """(marked dead, first and last affected request served again, their prompt lengths) per
    kill of `kind`."""
    out = []
    for kill in results["kills"]:
        done = [r for r in kill["requests"] if r["affected"] and r["recovery_s"] is not None]
        dead = kill["stages"].get("marked_dead_s")
        if kill["kind"] == kind and done and dead is not None:
            times = [r["recovery_s"] for r in done]
            out.append((dead, min(times), max(times), [r["prompt_tokens"] for r in done]))
    return out


def stages_table(results: dict) -> str:
    """The docs' table of where the time goes: P50 over the kills of each stage, and what
    bounds it (the settings as the run read them; the spans over its kills)."""
    st = results["settings"]
    by_kind = {k["kind"]: k for k in results["summary"]}

    def p50(kind: str, stage: str) -> float | None:
        return by_kind[kind]["stages_p50_s"].get(stage) if kind in by_kind else None

    grace = f"`disconnect_grace_s` = {st['disconnect_grace_s']:g}"
    tick = f"(`TICK_S` = {st['coordinator_tick_s']:g})"
    rows = [
        "| kill | process gone | marked dead by the coordinator | first token | bound by |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for kind in ("decode", "prefill", "tp-rank", "coordinator"):
        if kind not in by_kind or by_kind[kind]["p50_s"] is None:
            continue
        first = f"{by_kind[kind]['p50_s']:.2f}"
        spans = _per_kill(results, kind)
        if kind == "decode":
            more = [(lo - dead) * 1e3 for dead, lo, _, _ in spans]
            bound = (
                f"{grace} from its connections' close, then the coordinator's next tick {tick}; "
                f"the moved requests' prefill and first token take {min(more):.0f}-"
                f"{max(more):.0f} ms more"
            )
        elif kind == "prefill":
            counts = [len(p) for *_, p in spans]
            tokens = [t for *_, p in spans for t in p]
            bound = (
                f"the same, then the surviving prefill node prefills the {min(counts)}-"
                f"{max(counts)} moved prompts ({min(tokens)}-{max(tokens)} tokens) again, after "
                f"what it had queued itself: the first served again "
                f"{min(lo - d for d, lo, _, _ in spans):.2f}-{max(lo - d for d, lo, _, _ in spans):.2f} s "
                f"after the node was marked dead, the last "
                f"{min(hi - d for d, _, hi, _ in spans):.2f}-{max(hi - d for d, _, hi, _ in spans):.2f} s"
            )
        elif kind == "tp-rank":
            bound = (
                "its rank 0 ending its process once it sees the rank's exit (a thread waiting on "
                "the ranks' processes; then the kernel's teardown of the process), then "
                f"{grace} and the tick"
            )
        else:
            bound = (
                f"the supervisor's first restart delay (`backoff_s` "
                f"{st['supervisor_restart_delay_s']}, then its poll), the coordinator's start, "
                f"the nodes' reset and registration (`heartbeat_interval_s` = "
                f"{st['heartbeat_interval_s']:g})"
            )
        if kind == "coordinator":
            gone = (
                f"restarted {p50(kind, 'restarted_s'):.2f}; HTTP answers "
                f"{p50(kind, 'http_answer_s'):.2f}"
            )
            dead = "-"
        else:
            gone = f"{p50(kind, 'node_exited_s'):.2f}" + (
                " (its rank 0)" if kind == "tp-rank" else ""
            )
            dead = f"{p50(kind, 'marked_dead_s'):.2f}"
        rows.append(f"| {LABELS[kind]} | {gone} | {dead} | {first} | {bound} |")
    return "\n".join(rows)


def settings_line(results: dict) -> str:
    """The settings that bound a recovery, as the run read them from pdserve's defaults."""
    st = results["settings"]
    return (
        "The settings, as the benchmark read them from pdserve's defaults and printed them: "
        f"`heartbeat_interval_s` {st['heartbeat_interval_s']} (nodes), `heartbeat_timeout_s` "
        f"{st['heartbeat_timeout_s']}, `disconnect_grace_s` {st['disconnect_grace_s']}, the "
        f"coordinator's tick {st['coordinator_tick_s']} s, `transfer_timeout_s` "
        f"{st['transfer_timeout_s']}, `kv_streaming_timeout_s` {st['kv_streaming_timeout_s']}, "
        f"`max_retries` {st['max_retries']}; the supervisor of `pdserve launch`: restart delay "
        f"{st['supervisor_restart_delay_s']} s doubling to {st['supervisor_restart_delay_max_s']:g} "
        f"s, reset after `stable_s` {st['supervisor_stable_s']:g} s of uptime, a permanent error "
        f"after three deaths within `quick_death_s` {st['supervisor_quick_death_s']:g} s of a start."
    )


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
    record = provenance.start(["python", "-m", "pdserve.bench.recovery", *argv])
    print(f"load before: {record['load']['before']}", flush=True)
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
    summaries = [summarize(kind, kills[kind]) for kind in args.kinds]
    problems = verdict(summaries, strays, args.aim_check)
    result = provenance.finish(record) | {
        "model": args.model,
        "engine": {"kv_cache_bytes": args.kv_cache_bytes, "block_size": engine.block_size},
        "workload": {
            "requests_per_kill": args.requests,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "transport": args.transport,
        },
        "settings": settings,
        "aim_check": args.aim_check,
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
    print(f"load after: {result['load']['after']}")
    print(docs_table(result))
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
