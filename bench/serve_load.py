"""Load generator for any OpenAI-compatible completions endpoint: streams requests at a given rate
(Poisson or gamma arrivals) or concurrency, and reports TTFT, TPOT, ITL, latency, throughput and
goodput (requests per second that met both SLOs). Several rates (`--rate 1,2,4`) make a sweep;
`--plot` draws it.

    python -m pdserve.bench.serve_load --rate 4 --num-requests 20       # against pdserve serve's default
    python -m pdserve.bench.serve_load --base-url http://HOST:PORT --rate 1,2,4 --slo-ttft-ms 500 \\
        --slo-tpot-ms 30 --output run.json --plot run.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

from pdserve.bench.serving.plots import plot_sweeps
from pdserve.bench.serving.sweep import run_sweep
from pdserve.tune.load_generator import LoadConfig, format_summary, run_load
from pdserve.tune.serving_workload import (
    RequestSpec,
    SyntheticWorkload,
    approximate_token_count,
    load_sharegpt,
    load_tokenizer,
)
from pdserve.tune.slo import SLO


def length_range(text: str) -> tuple[int, int]:
    """`N` or `LO:HI`."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def rates(text: str) -> list[float]:
    return [math.inf if r.strip() in ("inf", "max") else float(r) for r in text.split(",")]


# Default SLOs: the first token within a second, then tokens at 20/s or faster (reading speed).
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 50.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.serve_load",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server, http://HOST:PORT (with or without /v1)",
    )
    p.add_argument(
        "--api-key", default=None, help="the server's API key, sent as `Authorization: Bearer KEY`"
    )
    p.add_argument("--model", default=None, help="model name (unset: the first of /v1/models)")
    p.add_argument(
        "--rate",
        type=rates,
        default=[math.inf],
        help="requests/s (inf: all at once), or a,b,c for a sweep",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (unset: no limit)",
    )
    p.add_argument("--num-requests", type=int, default=100, help="per rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=SLO_TTFT_MS,
        help="time-to-first-token objective for goodput",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=SLO_TPOT_MS,
        help="time-per-output-token objective for goodput",
    )
    p.add_argument(
        "--dataset",
        choices=["synthetic", "sharegpt"],
        default="synthetic",
        help="random token prompts, or conversations from a ShareGPT file",
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (or its folder) for ShareGPT lengths"
    )
    p.add_argument(
        "--short-prompt-len",
        type=length_range,
        default=(16, 64),
        help="synthetic prompt tokens, N or LO:HI",
    )
    p.add_argument(
        "--short-output-len",
        type=length_range,
        default=(64, 128),
        help="synthetic output tokens, N or LO:HI",
    )
    p.add_argument(
        "--long-fraction",
        type=float,
        default=0.0,
        help="share of synthetic requests that are long prompts",
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
    p.add_argument(
        "--prompt-format",
        choices=["tokens", "text"],
        default="tokens",
        help="synthetic prompts as token ids or as words",
    )
    p.add_argument(
        "--token-id-range", type=length_range, default=(10, 500), help="synthetic token ids, LO:HI"
    )
    p.add_argument("--no-usage", action="store_true", help="do not ask for stream usage")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="ask for logprobs, so that every token comes in a chunk of its own",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--label", default="server", help="the system's name in results and plots")
    p.add_argument("--output", default=None, help="results JSON")
    p.add_argument("--plot", default=None, help="PNG of the sweep")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def sampler(args: argparse.Namespace):  # noqa: ANN201
    """(seed, rate) -> that point's requests."""
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset sharegpt needs --dataset-path")
        count = load_tokenizer(args.tokenizer) if args.tokenizer else approximate_token_count
        return lambda seed, rate: load_sharegpt(args.dataset_path, args.num_requests, seed, count)
    workload = SyntheticWorkload(
        short_prompt_len=args.short_prompt_len,
        short_output_len=args.short_output_len,
        long_fraction=args.long_fraction,
        long_prompt_len=args.long_prompt_len,
        long_output_len=args.long_output_len,
        prompt_format=args.prompt_format,
        token_id_range=args.token_id_range,
    )
    return lambda seed, rate: workload.sample(args.num_requests, seed)


def warmup_specs(args: argparse.Namespace) -> list[RequestSpec]:
    workload = SyntheticWorkload(
        short_prompt_len=(16, 16), short_output_len=(8, 8), prompt_format=args.prompt_format
    )
    return workload.sample(args.warmup, seed=args.seed + 1_000_003)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sample = sampler(args)
    cfg = LoadConfig(
        base_url=args.base_url,
        model=args.model,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        include_usage=not args.no_usage,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        extra_body={} if args.logprobs is None else {"logprobs": args.logprobs},
        api_key=args.api_key,
    )
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    if len(args.rate) == 1 and not args.plot:
        cfg.rate = args.rate[0]
        result = asyncio.run(run_load(sample(args.seed, cfg.rate), cfg, slo, warmup_specs(args)))
        print(format_summary(result["summary"]))
    else:
        result = asyncio.run(run_sweep(sample, args.rate, cfg, slo, args.label, warmup_specs(args)))
        if args.plot:
            print(plot_sweeps([result], args.plot, args.label))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
