"""Chaos soak: mixed requests through a 1 prefill + 2 decode cluster while faults are injected,
one fault kind per phase, then all at once, each phase on a fresh cluster. A fault may fail a
request, with a clear error; it may never serve a wrong token, hold a request past its deadline
or leak a KV block.

    python -m pdserve.bench.chaos                                  # every phase, 2,000 requests each
    python -m pdserve.bench.chaos --requests 200 --phases none,kv-corrupt
    python -m pdserve.bench.chaos --rate 0.05 --json-out bench/results/chaos.json

Phases (--phases): `none` (no fault: the baseline, which must serve every request identical to
the offline engine before anything else means anything; the phases after it are skipped when it
does not), `kv-corrupt` (PDSERVE_KV_FAULTS: KV pages corrupted in flight), one per
PDSERVE_FAULTS kind (`drop`, `delay`, `duplicate`, `reorder`, `truncate`, `corrupt`: of the
messages on the node links and of the KV transfers' control and page messages, each at --rate;
`stall` at --rate/10 and `kill` at --rate/40 per node step) and `all` (every one of them at once,
kv-corrupt's included). The cluster is `pdserve launch` of a one-host cluster file, whose
supervisor restarts a killed node (`pdserve serve` does not); its coordinator has
request_timeout_s and transfer_timeout_s short (--request-timeout-s, --transfer-timeout-s).

Every request has one right answer (temperature 0, or 0.8 with a seed) and asks for logprobs, so
each token comes back by its string: the offline engine (`pdserve.engine.LLM`, same model, same
prompts) gives the references once. Per phase: the requests completed and identical to the
reference, completed and wrong, failed with an OpenAI-style error (by status and code), ended
unclearly (a cut connection, a stream without [DONE] or an error event), overdue (a client-side
time over request_timeout_s + --deadline-slack-s, or no end at all), the KV blocks not free again
once the requests are over (waited for, bounded), the supervisor's restarts, and each process's
private memory (RssAnon) from the phase's first sample to its last, and from its first sample
after warm-up (--sample-every requests) to its last (not for a process restarted in between).
Exits 1 when the `none` phase is not all identical, or when any phase serves a wrong token, has
an overdue or unclear request, leaks a block, loses its cluster, leaves a process behind, runs
out of --phase-timeout-s, or sets PDSERVE_FAULTS that no process's log says it injects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.chaos_cluster import FAULTS_ENV, KV_FAULTS_ENV, ChaosCluster, counters
from pdserve.bench.chaos_requests import (
    ChaosRequest,
    Choice,
    Outcome,
    difference,
    example,
    references,
    request_mix,
    send,
)
from pdserve.bench.process_tree import Sessions
from pdserve.bench.soak import kv_blocks
from pdserve.cluster.node_options import NodeOptions
from pdserve.cluster.schema import defaults
from pdserve.engine.embedded.catalog import TINY, model_name
from pdserve.engine.llm import LLM
from pdserve.tune import provenance

# The PDSERVE_FAULTS kinds, one phase each, and the fraction of --rate each gets: stall and kill
# act per node step, and a step is far more frequent than a message that matters.
KINDS = ("drop", "delay", "duplicate", "reorder", "truncate", "corrupt", "stall", "kill")
RATE_SCALE = {"stall": 1 / 10, "kill": 1 / 40}
# Two of a node's reports (heartbeat_interval_s), after which the coordinator's counters hold
# every count of the phase's requests.
REPORT_WAIT_S = 2 * defaults(NodeOptions)["heartbeat_interval_s"]
EXAMPLES = 5  # wrong, overdue, unclear requests kept per phase (and per error kind)


def phase_table(
    rate: float, seed: int, delay_ms: int | None = None, stall_ms: int | None = None
) -> dict[str, dict[str, str]]:
    """Each phase's name and the environment its processes get (its faults)."""
    rates = {kind: rate * RATE_SCALE.get(kind, 1.0) for kind in KINDS}
    extra = "".join(
        f",{name}={value}"
        for name, value in (("delay_ms", delay_ms), ("stall_ms", stall_ms))
        if value is not None
    )

    def faults(kinds: list[str]) -> str:
        return ",".join(f"{k}={rates[k]:g}" for k in kinds) + f",seed={seed}{extra}"

    kv_corrupt = {KV_FAULTS_ENV: f"corrupt={rate:g},seed={seed}"}
    table: dict[str, dict[str, str]] = {"none": {}, "kv-corrupt": kv_corrupt}
    table |= {kind: {FAULTS_ENV: faults([kind])} for kind in KINDS}
    table["all"] = {FAULTS_ENV: faults(list(KINDS)), **kv_corrupt}
    return table


PHASES = tuple(phase_table(0.02, 0))


@dataclass(slots=True)
class PhaseResult:
    phase: str
    faults: dict[str, str]
    requests: int
    completed: int = 0
    identical: int = 0
    wrong: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # by kind: "HTTP 504 timeout", ...
    unclear: int = 0
    hung: int = 0  # no end within the client's bound (each is overdue too)
    not_sent: int = 0  # left when the phase ran out of --phase-timeout-s
    overdue: int = 0
    leaked_blocks: dict[str, int] = field(default_factory=dict)  # by node: total - free
    nodes_up: dict[str, int] = field(default_factory=dict)  # /health at the end
    restarts: dict[str, int] = field(default_factory=dict)  # by process, the supervisor's
    # By process, first sample to last (None: restarted in between).
    anon_growth_mib: dict[str, float | None] = field(default_factory=dict)
    # ... from the first sample after --sample-every requests (warm-up's allocations left out)
    anon_growth_after_warmup_mib: dict[str, float | None] = field(default_factory=dict)
    memory_samples: list[dict] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # the coordinator's, at the end
    fault_log_lines: int = 0  # lines of its processes' logs naming PDSERVE_FAULTS
    elapsed_s: float = 0.0
    max_request_s: float = 0.0
    examples: dict[str, list[dict]] = field(default_factory=dict)
    error: str | None = None  # why the phase could not run to its end
    strays: list = field(default_factory=list)  # processes left after its cluster stopped

    @property
    def total_failed(self) -> int:
        return sum(self.failed.values())

    @property
    def leaked(self) -> int:
        return sum(self.leaked_blocks.values())

    def summary(self) -> dict:
        return asdict(self) | {"total_failed": self.total_failed, "leaked": self.leaked}


def tally(
    result: PhaseResult,
    request: ChaosRequest,
    expected: list[Choice],
    outcome: Outcome,
    deadline_s: float,
) -> None:
    """Count one request's outcome into its phase, keeping the first few that went wrong."""

    def keep(kind: str, why: str) -> None:
        kept = result.examples.setdefault(kind, [])
        if len(kept) < EXAMPLES:
            kept.append(example(request, outcome, why))

    result.max_request_s = max(result.max_request_s, outcome.elapsed_s)
    if outcome.status == "completed":
        result.completed += 1
        why = difference(expected, outcome.choices)
        if why is None:
            result.identical += 1
        else:
            result.wrong += 1
            keep("wrong", why)
    elif outcome.status == "failed":
        result.failed[outcome.error] = result.failed.get(outcome.error, 0) + 1
        keep(f"failed: {outcome.error}", outcome.detail or "")
    elif outcome.status == "hung":
        result.hung += 1
    else:
        result.unclear += 1
        keep("unclear", outcome.detail or "")
    if outcome.status == "hung" or outcome.elapsed_s > deadline_s:
        result.overdue += 1
        keep("overdue", f"{outcome.status} after {outcome.elapsed_s:.1f} s")


def growth(samples: list[dict], after: int = 0) -> dict[str, float | None]:
    """Per process, MiB of private memory (RssAnon) its last sample holds over its first one
    taken once `after` requests were done; None for a process the supervisor restarted during
    the phase (a new process, maybe still loading when first sampled, measures nothing)."""
    after = min(after, samples[-1]["requests"])
    considered = [s for s in samples if s["requests"] >= after]
    out: dict[str, float | None] = {}
    for name, last in samples[-1]["memory"].items():
        first = next(s["memory"][name] for s in considered if name in s["memory"])
        restarted = any(
            s["memory"].get(name, {}).get("pid", last["pid"]) != last["pid"] for s in samples
        )
        out[name] = None if restarted else round(last["anon"] - first["anon"], 1)
    return out


async def drive(
    args: argparse.Namespace,
    cluster: ChaosCluster,
    requests: list[ChaosRequest],
    expected: list[list[Choice]],
    result: PhaseResult,
) -> None:
    """Every request at --concurrency; then, bounded, every node up and every block free."""
    deadline_s = args.request_timeout_s + args.deadline_slack_s
    bound_s = deadline_s + args.client_extra_s
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    start = time.monotonic()

    def sample(done: int) -> None:
        result.memory_samples.append(
            {
                "requests": done,
                "elapsed_s": round(time.monotonic() - start, 2),
                "memory": cluster.memory(),
            }
        )

    every = args.sample_every or max(1, len(requests) // 8)
    points = set(range(0, len(requests), every))
    async with httpx.AsyncClient(base_url=cluster.url, timeout=bound_s, limits=limits) as client:
        served = (await client.get("/v1/models")).json()["data"][0]["id"]
        if served != requests[0].body["model"]:
            raise RuntimeError(f"the cluster serves {served!r}, the requests name another")
        sample(0)
        next_index = 0
        done = 0

        async def worker() -> None:
            nonlocal next_index, done
            while next_index < len(requests):
                if time.monotonic() - start > args.phase_timeout_s:
                    result.not_sent = len(requests) - next_index
                    return
                request = requests[next_index]
                next_index += 1
                outcome = await send(client, request, bound_s)
                tally(result, request, expected[request.index], outcome, deadline_s)
                done += 1
                if done in points:
                    sample(done)
                if args.progress and done % max(1, len(requests) // 10) == 0:
                    print(f"  {result.phase}: {done}/{len(requests)}", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        result.elapsed_s = round(time.monotonic() - start, 2)
        await settle(args, cluster, client, result)
        sample(len(requests))
    result.anon_growth_mib = growth(result.memory_samples)
    result.anon_growth_after_warmup_mib = growth(result.memory_samples, every)


async def settle(
    args: argparse.Namespace, cluster: ChaosCluster, client: httpx.AsyncClient, result: PhaseResult
) -> None:
    """After the requests: until every node is up (a killed one restarted) and reports all its
    KV blocks free, for at most --settle-timeout-s; what is not free then is leaked."""
    wanted = {"prefill": args.prefill_nodes, "decode": args.decode_nodes}
    deadline = time.monotonic() + args.settle_timeout_s
    blocks: dict[str, tuple[float, float]] = {}
    while True:
        try:
            health = (await client.get("/health")).json()
            result.nodes_up = {r: health.get("nodes", {}).get(r, 0) for r in wanted}
            blocks = kv_blocks((await client.get("/metrics")).text)
        except (httpx.HTTPError, ValueError):
            pass
        up = result.nodes_up == wanted and len(blocks) == sum(wanted.values())
        if up and all(free == total for free, total in blocks.values()):
            break
        if time.monotonic() > deadline or not cluster.running():
            break
        await asyncio.sleep(0.25)
    result.leaked_blocks = {node: int(total - free) for node, (free, total) in blocks.items()}
    await asyncio.sleep(REPORT_WAIT_S)  # the nodes' next reports carry their last counts
    try:
        result.counters = counters((await client.get("/metrics")).text)
    except httpx.HTTPError:
        pass


def run_phase(
    args: argparse.Namespace,
    name: str,
    faults: dict[str, str],
    requests: list[ChaosRequest],
    expected: list[list[Choice]],
) -> PhaseResult:
    """One phase on a fresh cluster, which is stopped at its end."""
    result = PhaseResult(name, faults, len(requests))
    config = {
        "request_timeout_s": args.request_timeout_s,
        "transfer_timeout_s": args.transfer_timeout_s,
    }
    sessions = Sessions()
    try:
        with ChaosCluster(
            args.work_dir / name,
            args.model,
            config,
            faults,
            prefill=args.prefill_nodes,
            decode=args.decode_nodes,
            transport=args.transport,
            kv_cache_bytes=args.kv_cache_bytes,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            sessions=sessions,
        ) as cluster:
            try:
                asyncio.run(drive(args, cluster, requests, expected, result))
            finally:
                result.restarts = cluster.restarts()
                result.fault_log_lines = cluster.log_lines_naming(FAULTS_ENV)
            if not cluster.running():
                result.error = f"pdserve launch exited during the phase; see {cluster.console}"
    except Exception as exc:  # this phase's failure; the others still run
        result.error = f"{type(exc).__name__}: {exc}"
    result.strays = sessions.strays()
    sessions.kill_strays(result.strays)
    return result


def problems(results: list[PhaseResult]) -> list[str]:
    """What fails the run; empty when it passes."""
    out = []
    for r in results:
        p = r.phase
        if r.error:
            out.append(f"{p}: {r.error}")
        if p == "none" and r.identical != r.requests:
            out.append(
                f"none: {r.identical} of {r.requests} requests identical to the offline engine "
                "(the baseline must be all: nothing else means anything until it is)"
            )
        if FAULTS_ENV in r.faults and not r.fault_log_lines and not r.error:
            out.append(
                f"{p}: no process's log names {FAULTS_ENV}: its faults were not injected (no "
                "fault layer, or the variable did not reach the processes)"
            )
        if r.not_sent:
            out.append(f"{p}: {r.not_sent} requests not sent within --phase-timeout-s")
        if r.wrong:
            out.append(f"{p}: {r.wrong} completed requests served wrong tokens")
        if r.overdue:
            out.append(f"{p}: {r.overdue} requests outlived their deadline ({r.hung} never ended)")
        if r.unclear:
            out.append(f"{p}: {r.unclear} requests ended without a clear error")
        if r.leaked:
            out.append(f"{p}: KV blocks not free after the requests: {r.leaked_blocks}")
        if r.strays:
            out.append(f"{p}: processes left running: {r.strays}")
    return out


def render(results: list[PhaseResult]) -> str:
    """The Markdown table of the phases run so far."""
    return docs_table({"phases": [r.summary() for r in results]})


def docs_table(results: dict) -> str:
    """The docs' table of a results file: a row per phase (`python -m pdserve.bench.docs`)."""
    lines = [
        "| phase | requests | identical | wrong | failed (clear error) | unclear | overdue | "
        "leaked blocks | restarts | integrity failures caught | slowest request (s) | phase (s) |",
        "| --- |" + " ---: |" * 11,
    ]
    for r in results["phases"]:
        integrity = sum(v for k, v in r["counters"].items() if "integrity" in k)
        failed = str(r["total_failed"])
        if r["failed"]:
            failed += " (" + ", ".join(r["failed"]) + ")"
        lines.append(
            f"| {r['phase']} | {r['requests']:,} | {r['identical']:,} | {r['wrong']} | {failed} "
            f"| {r['unclear']} | {r['overdue']} | {r['leaked']} | {sum(r['restarts'].values())} "
            f"| {integrity:.0f} | {r['max_request_s']:.1f} | {r['elapsed_s']:.1f} |"
        )
    return "\n".join(lines)


def describe(r: PhaseResult) -> str:
    """One phase's details under the table: its faults, errors by kind, what went wrong."""
    faults = " ".join(f"{k}={v}" for k, v in r.faults.items()) or "no faults"
    lines = [f"{r.phase}: {faults}"]
    if r.error:
        lines.append(f"  error: {r.error}")
    if r.not_sent:
        lines.append(f"  not sent (out of --phase-timeout-s): {r.not_sent}")
    for kind, count in Counter(r.failed).most_common():
        lines.append(f"  failed {count}: {kind}")
    if r.restarts:
        lines.append(f"  restarts: {r.restarts}")
    lines.append(f"  private memory growth (MiB), first to last sample: {r.anon_growth_mib}")
    lines.append(f"  ... after warm-up: {r.anon_growth_after_warmup_mib}")
    lines.append(f"  nodes up at the end: {r.nodes_up}")
    lines.append(f"  slowest request: {r.max_request_s:.1f} s")
    for kind in ("wrong", "overdue", "unclear"):
        for e in r.examples.get(kind, []):
            lines.append(
                f"  {kind}: request {e['index']} (id {e['request_id']}, trace {e['trace_id']}): "
                f"{e['why']}"
            )
    return "\n".join(lines)


def phase_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"phases are {', '.join(PHASES)}; got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=2000, help="requests per phase (2000)")
    p.add_argument(
        "--phases",
        type=phase_names,
        default=list(PHASES),
        help=f"comma-separated, in order (all: {','.join(PHASES)})",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=0.02,
        help="each fault's probability per message (0.02); stall gets rate/10, kill rate/40 "
        "(per node step), kv-corrupt rate (per landing)",
    )
    p.add_argument("--delay-ms", type=int, help="PDSERVE_FAULTS delay_ms (unset: its default)")
    p.add_argument("--stall-ms", type=int, help="PDSERVE_FAULTS stall_ms (unset: its default)")
    p.add_argument("--fault-seed", type=int, default=7, help="the faults' seed (7)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    p.add_argument("--seed", type=int, default=0, help="of the request mix (0)")
    p.add_argument("--max-prompt-len", type=int, default=120, help="words or token ids (120)")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="the coordinator's (60)")
    p.add_argument("--transfer-timeout-s", type=float, default=5.0, help="the coordinator's (5)")
    p.add_argument(
        "--deadline-slack-s",
        type=float,
        default=5.0,
        help="a request is overdue past request_timeout_s + this, client-side (5)",
    )
    p.add_argument(
        "--client-extra-s",
        type=float,
        default=30.0,
        help="the client gives up (hung) this long after the deadline (30)",
    )
    p.add_argument(
        "--settle-timeout-s",
        type=float,
        default=30.0,
        help="after the requests, the longest wait for every node up and every block free (30)",
    )
    p.add_argument(
        "--sample-every",
        type=int,
        help="requests between memory samples (unset: an eighth of --requests); growth "
        "'after warm-up' counts from the first sample after this many",
    )
    p.add_argument(
        "--phase-timeout-s",
        type=float,
        default=3600.0,
        help="no request is sent after a phase has run this long: the ones left count as not "
        "sent, and fail the run (3600)",
    )
    p.add_argument("--model", default=TINY, help=f"embedded name or directory ({TINY})")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=2)
    p.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="each node's KV pool")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/pdserve-chaos"),
        help="each phase's cluster file, config and logs",
    )
    p.add_argument("--json-out", type=Path, help="write the results file here")
    p.add_argument(
        "--otlp-traces-endpoint",
        help="every process of a phase exports its traces there, and the examples of wrong, "
        "overdue and unclear requests name their trace ids (x-pdserve-trace-id)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def prepare(args: argparse.Namespace) -> tuple[list[ChaosRequest], list[list[Choice]]]:
    """The request mix and its references from the offline engine."""
    with LLM(args.model, device="cpu", kv_cache_bytes=args.kv_cache_bytes) as llm:
        requests = request_mix(
            args.requests, args.seed, model_name(args.model), args.max_prompt_len, llm
        )
        return requests, references(requests, llm, args.model)


def run(args: argparse.Namespace, argv: list[str]) -> tuple[dict, list[PhaseResult]]:
    """Every phase asked for: the results file's content and the phases' results."""
    table = phase_table(args.rate, args.fault_seed, args.delay_ms, args.stall_ms)
    record = provenance.start(["python", "-m", "pdserve.bench.chaos", *argv])
    started = time.monotonic()
    requests, expected = prepare(args)
    print(
        f"references: {len(requests)} requests from the offline engine in "
        f"{time.monotonic() - started:.1f} s",
        flush=True,
    )
    results = []
    for name in args.phases:
        print(f"--- {name}: {table[name] or 'no faults'}", flush=True)
        result = run_phase(args, name, table[name], requests, expected)
        results.append(result)
        print(render([result]))
        print(describe(result), flush=True)
        if name == "none" and problems([result]):
            skipped = args.phases[len(results) :]
            print(f"the baseline failed: {', '.join(skipped) or 'nothing'} skipped", flush=True)
            break
    found = problems(results)
    result_file = provenance.finish(record) | {
        "model": args.model,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rate_scale": RATE_SCALE,
        "phase_faults": {name: table[name] for name in args.phases},
        "mix": {
            "streamed": sum(r.body["stream"] for r in requests),
            "greedy": sum(r.body["temperature"] == 0 for r in requests),
            "n2": sum(len(r.params) > 1 for r in requests),
            "with_stop": sum(bool(r.stop) for r in requests),
            "finish_reasons": dict(Counter(c.finish_reason for e in expected for c in e)),
        },
        "phases": [r.summary() for r in results],
        "skipped": args.phases[len(results) :],  # after a failed baseline
        "problems": found,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    return result_file, results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    result_file, results = run(args, argv)
    print()
    print(docs_table(result_file))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result_file, indent=1) + "\n")
        print(f"results: {args.json_out}")
    for problem in result_file["problems"]:
        print(f"FAIL {problem}")
    print("PASS" if not result_file["problems"] else f"{len(result_file['problems'])} problem(s)")
    return 1 if result_file["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
