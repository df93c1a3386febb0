"""Memory soak: serves thousands of mixed requests through `pdserve serve` and samples the resident
memory of the coordinator and of every node process as they go. A process that keeps something
per request grows linearly with the requests served; one that does not levels off after warm-up.

    python -m pdserve.bench.soak                                   # 10,000 requests, 1 prefill + 1 decode
    python -m pdserve.bench.soak --requests 4000 --transport shm --json-out bench/results/soak.json

The load: after `--warmup` requests, `--requests` more at `--concurrency`, streamed and not, some
with n=2, stop strings, seeds or temperature 0, prompts of random length (text or token ids), and
a tenth of the streams dropped by the client after a few chunks. Exits non-zero when a request
failed, when a node's KV blocks are not all free at the end, or when a process's private memory
(RssAnon: not the pages of a shared KV pool, which fill up to its size as blocks are first used)
grew by more than `--max-growth-mib` over the second half of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.serving.process_memory import pdserve_processes, resident_mib
from pdserve.tune import provenance
from pdserve.tune.local_server import PdserveServer, PdserveSystem

REPO_ROOT = Path(__file__).resolve().parents[1]

WORDS = "once upon a time there was a cat who liked the river and the small red ball".split()


@dataclass(slots=True)
class Sample:
    requests: int  # completed (or dropped) after warm-up when sampled
    elapsed_s: float
    memory: dict[str, dict[str, float]]  # process -> `resident_mib` (rss, anon, shmem)


@dataclass(slots=True)
class Tally:
    completed: int = 0
    dropped: int = 0  # streams the client left on purpose
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few


def request_body(i: int, model: str, max_prompt_len: int) -> tuple[dict, bool]:
    """Request i of the mix, and whether the client drops its stream after a few chunks."""
    rng = random.Random(i)
    length = rng.randrange(1, max_prompt_len + 1)
    if rng.random() < 0.5:
        prompt: str | list[int] = " ".join(rng.choice(WORDS) for _ in range(length))
    else:
        prompt = [rng.randrange(4, 500) for _ in range(length)]
    body: dict = {"model": model, "prompt": prompt, "max_tokens": rng.randrange(1, 49)}
    if rng.random() < 0.3:
        body["temperature"] = 0
    else:
        body["temperature"] = 0.8
        body["seed"] = i
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.2:
        body["stop"] = [".", " the"]
    stream = rng.random() < 0.5
    body["stream"] = stream
    return body, stream and rng.random() < 0.2  # a tenth of all streams dropped


async def send(client: httpx.AsyncClient, url: str, body: dict, drop: bool, tally: Tally) -> None:
    def fail(why: str) -> None:
        tally.failed += 1
        if len(tally.errors) < 10:
            tally.errors.append(why)

    try:
        if not body["stream"]:
            response = await client.post(url, json=body)
            if response.status_code != 200:
                return fail(f"HTTP {response.status_code}: {response.text[:200]}")
            tally.completed += 1
            return
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return fail(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line.startswith('data: {"error"'):
                    return fail(line[:200])
                if line == "data: [DONE]":
                    tally.completed += 1
                    return
                chunks += 1
                if drop and chunks >= 3:
                    tally.dropped += 1
                    return  # leaving the block closes the connection: the server aborts it
            if drop:
                tally.dropped += 1  # it ended before its third chunk
            else:
                fail("stream ended without [DONE]")
    except httpx.HTTPError as exc:
        fail(f"{type(exc).__name__}: {exc}")


def kv_blocks(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(free, total) KV blocks of each node, from the coordinator's /metrics."""
    free: dict[str, float] = {}
    total: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "pdserve_kv_blocks_free":
                free[s.labels["node"]] = s.value
            elif s.name == "pdserve_kv_blocks_total":
                total[s.labels["node"]] = s.value
    return {node: (free.get(node, 0.0), total[node]) for node in total}


async def wait_all_blocks_free(client: httpx.AsyncClient, base: str, timeout_s: float) -> dict:
    """Until every node reports all its KV blocks free (their next load report); the last
    (free, total) seen per node."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = kv_blocks((await client.get(base + "/metrics")).text)
        if blocks and all(free == total for free, total in blocks.values()):
            return blocks
        if time.monotonic() > deadline:
            return blocks
        await asyncio.sleep(0.25)


async def soak(args: argparse.Namespace, base: str, root_pid: int) -> dict:
    processes = pdserve_processes(root_pid)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout_s, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        tally = Tally()
        samples: list[Sample] = []
        start = time.monotonic()
        total = args.warmup + args.requests
        # After the warm-up, every sample_every requests, at the midpoint and at the end.
        points = {0, args.requests // 2, args.requests}
        points |= set(range(0, args.requests, max(1, args.sample_every)))
        next_index = 0
        done = 0

        async def worker() -> None:
            nonlocal next_index, done
            while next_index < total:
                i = next_index
                next_index += 1
                body, drop = request_body(args.seed * 1_000_003 + i, model, args.max_prompt_len)
                await send(client, "/v1/completions", body, drop, tally)
                done += 1
                if done - args.warmup in points:
                    memory = {name: resident_mib(pid) for name, pid in processes.items()}
                    elapsed = round(time.monotonic() - start, 2)
                    samples.append(
                        Sample(
                            done - args.warmup,
                            elapsed,
                            {
                                name: {k: round(v, 1) for k, v in m.items()}
                                for name, m in memory.items()
                                if m is not None
                            },
                        )
                    )

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        blocks = await wait_all_blocks_free(client, base, timeout_s=30.0)
    return {
        "model": model,
        "processes": processes,
        "samples": samples,
        "tally": tally,
        "kv_blocks": blocks,
    }


def growth_over_second_half(
    samples: list[Sample], requests: int, kind: str = "anon"
) -> dict[str, float]:
    """Per process, MiB of `kind` that the highest sample of the second half of the measured
    requests holds over the highest of the first half (the midpoint's included). Peaks, since
    the allocator gives memory back now and then: a dip is not the process shrinking, while a
    leak lifts every peak."""
    first = [s for s in samples if s.requests <= requests // 2]
    second = [s for s in samples if s.requests > requests // 2]
    growth = {}
    for name in samples[-1].memory:
        before = [s.memory[name][kind] for s in first if name in s.memory]
        after = [s.memory[name][kind] for s in second if name in s.memory]
        if before and after:
            growth[name] = round(max(after) - max(before), 1)
    return growth


def render(samples: list[Sample], kinds: tuple[str, ...] = ("rss", "anon")) -> str:
    """A Markdown table: a row per process and kind of memory, a column per sample."""
    return memory_table({"samples": [asdict(s) for s in samples]}, kinds=",".join(kinds))


def memory_table(results: dict, every: str = "1", kinds: str = "rss,anon") -> str:
    """The docs' table of a results file: a row per process and kind of memory (`kinds`, comma
    separated), a column per sample taken after a multiple of `every` measured requests."""
    step, wanted = int(every), kinds.split(",")
    samples = [s for s in results["samples"] if s["requests"] % step == 0]
    lines = [
        "| process | memory | " + " | ".join(f"{s['requests']:,}" for s in samples) + " |",
        "| --- | --- |" + " ---: |" * len(samples),
    ]
    for name in results["samples"][-1]["memory"]:
        for kind in wanted:
            cells = [
                s["memory"][name][kind] if name in s["memory"] else float("nan") for s in samples
            ]
            lines.append(f"| {name} | {kind} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=10_000, help="measured requests (10000)")
    p.add_argument("--warmup", type=int, default=200, help="requests before the first sample")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--sample-every", type=int, default=1000, help="requests between samples")
    p.add_argument("--max-prompt-len", type=int, default=120, help="words or token ids")
    p.add_argument(
        "--max-growth-mib",
        type=float,
        default=16.0,
        help="the most a process may grow over the second half (16)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--transport", default="tcp")
    p.add_argument("--kv-cache-bytes", type=int, default=128 << 20)
    p.add_argument("--model", help="checkpoint directory (unset: pdserve's default)")
    p.add_argument(
        "--serve-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more `pdserve serve` argument (repeat: --serve-flag=--cpu-linear "
        "--serve-flag=torch)",
    )
    p.add_argument(
        "--work-dir", type=Path, default=Path("/tmp/pdserve-soak"), help="the server's logs"
    )
    p.add_argument("--json-out", type=Path, help="write the results file here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[dict, list[Sample], list[str]]:
    """Serve the soak: its results file, its samples and what it found wrong (empty: nothing)."""
    flags = (
        "--transport",
        args.transport,
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        *args.serve_flag,
    )
    system = PdserveSystem("soak", args.prefill_nodes, args.decode_nodes, flags=flags)
    record = provenance.start(sys.argv)
    with PdserveServer(system, args.work_dir, model=args.model) as server:
        out = asyncio.run(soak(args, server.base_url, server.proc.pid))
        command = server.command
    samples, tally = out["samples"], out["tally"]
    growth = growth_over_second_half(samples, args.requests)
    problems = [f"{tally.failed} requests failed: {tally.errors}"] if tally.failed else []
    problems += [
        f"{node}: {free:.0f} of {total:.0f} KV blocks free at the end"
        for node, (free, total) in out["kv_blocks"].items()
        if free != total
    ]
    problems += [
        f"{name}'s private memory grew {mib:.1f} MiB over the second half (at most "
        f"{args.max_growth_mib})"
        for name, mib in growth.items()
        if mib > args.max_growth_mib
    ]
    result = provenance.finish(record) | {
        "serve_command": command,
        "model": out["model"],
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "processes": out["processes"],
        "samples": [asdict(s) for s in samples],
        "anon_growth_second_half_mib": growth,
        "rss_growth_second_half_mib": growth_over_second_half(samples, args.requests, "rss"),
        "tally": asdict(tally),
        "kv_blocks_end": out["kv_blocks"],
        "problems": problems,
    }
    return result, samples, problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result, samples, problems = run(args)
    print(f"resident memory (MiB) after N measured requests (warm-up: {args.warmup}):")
    print(memory_table(result))
    print(
        "growth over the second half (MiB), private:",
        result["anon_growth_second_half_mib"],
        "all:",
        result["rss_growth_second_half_mib"],
    )
    tally = result["tally"]
    print(
        f"completed {tally['completed']}, dropped by the client {tally['dropped']}, "
        f"failed {tally['failed']}"
    )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    for problem in problems:
        print("FAILED:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
