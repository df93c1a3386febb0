"""What each HTTP front end costs the coordinator per streamed token, side by side in one run:
the same conversations sent as chat completions, as Responses API requests and as Messages API
requests, streamed, greedy, at one Poisson rate, to one `pdserve serve` (pdserve-stories, one
prefill and one decode node), rounds alternating the order of the APIs. The coordinator process's
CPU time over each API's part (from /proc), divided by the tokens it streamed, is the front end's
cost per token with the routing and detokenizing that every API shares; the ratio to chat is the
front end's own difference.

    python -m pdserve.bench.api_frontends
    python -m pdserve.bench.api_frontends --rate 4 --requests 32 --rounds 3 \
        --json-out bench/results/api_frontends.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from pdserve.bench.serving.cpu_use import CPUUse
from pdserve.tune import provenance
from pdserve.tune.local_server import PdserveServer, PdserveSystem

PROG = "pdserve.bench.api_frontends"
MODEL = "pdserve-stories"
QUESTIONS = (
    "Tell me a story about a cat.",
    "Where is the dog?",
    "Tell me a story about Lily and her ball.",
    "What does Tom like?",
    "Tell me a story about a bird in the garden.",
)


async def chat(client: httpx.AsyncClient, question: str, max_tokens: int) -> int:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def responses(client: httpx.AsyncClient, question: str, max_tokens: int) -> int:
    body = {
        "input": question,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "store": False,
    }
    tokens = 0
    async with client.stream("POST", "/v1/responses", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("type") in ("response.completed", "response.incomplete"):
                    tokens = event["response"]["usage"]["output_tokens"]
    return tokens


async def messages(client: httpx.AsyncClient, question: str, max_tokens: int) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    tokens = 0
    async with client.stream("POST", "/v1/messages", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("type") == "message_delta":
                    tokens = event["usage"]["output_tokens"]
    return tokens


APIS: dict[str, Callable[[httpx.AsyncClient, str, int], Awaitable[int]]] = {
    "chat": chat,
    "responses": responses,
    "messages": messages,
}


async def run_part(
    base_url: str, api: str, requests: int, rate: float, max_tokens: int, seed: int
) -> tuple[int, float]:
    """Sends `requests` streamed requests of one API at a Poisson rate: (tokens, seconds)."""
    rng = random.Random(seed)
    send = APIS[api]
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        start = time.monotonic()
        tasks = []
        for i in range(requests):
            tasks.append(
                asyncio.create_task(send(client, QUESTIONS[i % len(QUESTIONS)], max_tokens))
            )
            await asyncio.sleep(rng.expovariate(rate))
        tokens = sum(await asyncio.gather(*tasks))
        return tokens, time.monotonic() - start


def measure(args: argparse.Namespace, work_dir: Path) -> dict:
    system = PdserveSystem("frontends", flags=("--insecure",))
    parts: dict[str, list[dict]] = {api: [] for api in args.apis}
    with PdserveServer(system, work_dir, MODEL) as server:
        # Warm every path once (the first request of each compiles and caches what it needs).
        for api in args.apis:
            asyncio.run(run_part(server.base_url, api, 2, 100.0, args.max_tokens, 0))
        for round_ in range(args.rounds):
            order = args.apis if round_ % 2 == 0 else args.apis[::-1]
            for api in order:
                use = CPUUse(server.proc.pid, work_dir / "cpu", label=f"{api}-{round_}")
                use.begin()
                tokens, wall = asyncio.run(
                    run_part(server.base_url, api, args.requests, args.rate, args.max_tokens,
                             args.seed + round_)
                )  # fmt: skip
                cpu = use.end(tokens)
                coordinator = cpu["roles"].get("coordinator", {})
                parts[api].append(
                    {
                        "round": round_,
                        "tokens": tokens,
                        "wall_s": wall,
                        "coordinator_cpu_s": coordinator.get("cpu_s"),
                        "coordinator_ms_per_token": coordinator.get("ms_per_token"),
                        "roles": cpu["roles"],
                    }
                )
                print(
                    f"round {round_} {api}: {tokens} tokens in {wall:.1f} s, coordinator "
                    f"{coordinator.get('ms_per_token', float('nan')):.3f} ms/token",
                    flush=True,
                )
    summary = {}
    for api, runs in parts.items():
        per_token = [r["coordinator_ms_per_token"] for r in runs]
        summary[api] = {
            "coordinator_ms_per_token_median": statistics.median(per_token),
            "tokens_per_round": [r["tokens"] for r in runs],
        }
    chat_ms = summary.get("chat", {}).get("coordinator_ms_per_token_median")
    for api in summary:
        if chat_ms:
            summary[api]["ratio_to_chat"] = (
                summary[api]["coordinator_ms_per_token_median"] / chat_ms
            )
    return {"parts": parts, "summary": summary}


def docs_table(results: dict) -> str:
    """The coordinator's CPU per streamed token for each API (bench.docs renders it)."""
    lines = [
        "| API | coordinator CPU per streamed token (median of rounds) | vs chat | tokens per round |",
        "| --- | --- | --- | --- |",
    ]
    names = {"chat": "chat completions", "responses": "Responses", "messages": "Messages"}
    for api, s in results["summary"].items():
        ratio = s.get("ratio_to_chat")
        lines.append(
            f"| {names.get(api, api)} | {s['coordinator_ms_per_token_median']:.3f} ms | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | "
            f"{', '.join(map(str, s['tokens_per_round']))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apis", nargs="+", default=list(APIS), choices=list(APIS))
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=32, help="per API and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    record = provenance.start(sys.argv if argv is None else ["python", "-m", PROG, *argv])
    with tempfile.TemporaryDirectory(prefix="pdserve-frontends-") as tmp:
        results = provenance.finish(record) | {
            "args": vars(args) | {"json_out": str(args.json_out)}
        }
        results |= measure(args, Path(tmp))
    print(docs_table(results))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
