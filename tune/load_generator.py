"""Runs one load: sends a workload's requests to an OpenAI-compatible server at their arrival
times (open loop), optionally under a concurrency cap, streams every response, and sums it up."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from pdserve.tune.arrivals import arrival_offsets
from pdserve.tune.completion_stream import completion_body, send_completion
from pdserve.tune.serving_metrics import RequestResult, summarize
from pdserve.tune.serving_workload import RequestSpec
from pdserve.tune.slo import SLO


@dataclass(slots=True)
class LoadConfig:
    base_url: str  # http://host:port, with or without /v1
    model: str | None = None  # None: the first of GET /v1/models, or no model field
    rate: float = math.inf  # requests per second; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the gaps: 1 Poisson, < 1 bursty
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    seed: int = 0
    include_usage: bool = True  # stream_options.include_usage, for exact token counts
    timeout_s: float = 600.0
    progress: bool = True
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None  # sent as `Authorization: Bearer KEY`

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"


def _client(cfg: LoadConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    return httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits, headers=headers)


async def resolve_model(client: httpx.AsyncClient, cfg: LoadConfig) -> str | None:
    if cfg.model is not None:
        return cfg.model
    try:
        response = await client.get(cfg.api_root + "/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


async def run_load(
    specs: list[RequestSpec],
    cfg: LoadConfig,
    slo: SLO,
    warmup_specs: list[RequestSpec] | tuple[()] = (),
) -> dict:
    """Send `warmup_specs` one by one (not measured), then `specs` as configured; returns
    {"config", "summary", "requests"}."""
    async with _client(cfg) as client:
        model = await resolve_model(client, cfg)
        url = cfg.api_root + "/completions"
        for spec in warmup_specs:
            body = completion_body(spec, model, cfg.include_usage, cfg.extra_body)
            result = await send_completion(client, url, body, spec, time.perf_counter())
            if not result.success:
                raise RuntimeError(f"warmup request failed: {result.error}")
        offsets = arrival_offsets(len(specs), cfg.rate, cfg.burstiness, cfg.seed)
        cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(specs), disable=not cfg.progress, desc=f"rate {cfg.rate:g}/s")
        start = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            body = completion_body(spec, model, cfg.include_usage, cfg.extra_body)
            if cap is None:
                result = await send_completion(client, url, body, spec, start)
            else:
                async with cap:
                    result = await send_completion(client, url, body, spec, start)
            bar.update(1)
            return result

        tasks = []
        for spec, offset in zip(specs, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    config = {
        **asdict(cfg),
        "model": model,
        "num_requests": len(specs),
        "warmup": len(warmup_specs),
    }
    return {
        "config": config,
        "summary": summarize(results, duration, slo),
        "requests": [r.to_dict() for r in results],
    }


def format_summary(summary: dict) -> str:
    """The run's figures as a few aligned lines for the terminal."""
    lines = [
        f"requests  {summary['completed']}/{summary['num_requests']} ok in "
        f"{summary['duration_s']:.1f} s ({summary['failed']} failed)",
        f"throughput {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_token_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s",
        f"goodput   {summary['goodput']:.2f} req/s, SLO attainment "
        f"{summary['slo_attainment']:.0%} (TTFT <= {summary['slo']['ttft_ms']:g} ms, "
        f"TPOT <= {summary['slo']['tpot_ms']:g} ms)",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = summary[name]
        lines.append(
            f"{name[:-3].upper():5} ms  mean {d['mean']:8.1f}  p50 {d['p50']:8.1f}  "
            f"p90 {d['p90']:8.1f}  p99 {d['p99']:8.1f}"
        )
    return "\n".join(lines)
