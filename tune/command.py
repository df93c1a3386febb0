"""`pdserve tune` and `pdserve tune profile`: their flags and what each does with them. The
flags are declared here so that `pdserve`'s parser imports nothing heavy; the work is imported
when a command runs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
from pathlib import Path


def _ms(text: str) -> float:
    return float(text) / 1e3


DESCRIPTION = (
    "Search P:D placement, each role's tensor-parallel size, chunk size, max_num_seqs, admission watermark and conditional "
    "disaggregation for the most goodput under an SLO, in a simulator that runs pdserve's own "
    "scheduler, block manager, nodes and coordinator; write the winner as a config file for "
    "`pdserve serve --config` and a cluster file for `pdserve launch`. `pdserve tune profile` "
    "makes the profile it needs. See docs/tuning.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The search's flags on `parser`, and `profile` as its one sub-command."""
    parser.allow_abbrev = False  # the sub-command's flags must not read as the search's prefixes
    parser.add_argument(
        "--profile", help="profile JSON from `pdserve tune profile` (required: no default)"
    )
    parser.add_argument(
        "--model",
        help="checkpoint directory or config.json (default: the profile's model shape)",
    )
    parser.add_argument(
        "--devices", type=int, help="GPUs (or CPU workers) to place (required: no default)"
    )
    slo = parser.add_argument_group("SLO")
    slo.add_argument(
        "--slo-ttft-ms", type=float, help="time to first token target (required: no default)"
    )
    slo.add_argument(
        "--slo-tpot-ms", type=float, help="time per output token target (required: no default)"
    )
    slo.add_argument(
        "--slo-percentile",
        type=float,
        default=90.0,
        help="percent of requests that must meet both targets (default: 90)",
    )
    w = parser.add_argument_group("workload (synthetic unless --trace or --sharegpt)")
    w.add_argument(
        "--trace",
        help="CSV or JSON lines: arrival_s, prompt_len, output_len[, "
        "prefix_group, prefix_len] (unset: synthetic)",
    )
    w.add_argument(
        "--sharegpt",
        help="ShareGPT-format JSON, lengths from --model's tokenizer (unset: synthetic)",
    )
    w.add_argument("--num-requests", type=int, default=10000, help="requests simulated")
    w.add_argument(
        "--prompt-len",
        default="lognormal:160:1.0:1024",
        help="N, LO:HI or lognormal:MEDIAN:SIGMA[:MAX] (default: %(default)s)",
    )
    w.add_argument("--output-len", default="lognormal:250:0.7:1024", help="same forms")
    w.add_argument(
        "--long-fraction", type=float, default=0.0, help="of requests from the long ones"
    )
    w.add_argument("--long-prompt-len", default="1536:1900", help="same forms")
    w.add_argument("--long-output-len", default="8:16", help="same forms")
    w.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens every prompt starts with (a system prompt)",
    )
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson")
    w.add_argument(
        "--rate",
        type=float,
        default=None,
        help="also report latencies at this rate (req/s); default: at each goodput",
    )
    w.add_argument("--seed", type=int, default=0, help="of the synthetic lengths and arrivals")
    s = parser.add_argument_group("search")
    s.add_argument("--quick", action="store_true", help="a few values of each knob")
    s.add_argument(
        "--processes",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="simulations run in parallel",
    )
    s.add_argument("--top", type=int, default=5, help="candidates in the table")
    s.add_argument(
        "--out-dir",
        default="pdserve-tune",
        help="where pdserve.toml, cluster.toml, the plot and tune.json go",
    )
    s.add_argument(
        "--gpus-per-host",
        type=int,
        default=8,
        help="GPUs a host: node sizes (TP) must divide it; the cluster file's hosts",
    )
    s.add_argument("--no-plot", action="store_true", help="no goodput.png")
    s.add_argument(
        "--json-out",
        type=Path,
        default=None,
        help="also write tune.json here, with the run's provenance (default: unset, not written)",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="tune_command")
    p = sub.add_parser(
        "profile",
        help="measure (or derive) a profile: step and transfer times",
        description="Measure this machine's step times (real engine steps, fitted) and KV "
        "transfer, or derive them from a roofline of a device's stated peaks (--roofline) or from "
        "`python -m pdserve.bench.model_step --json` (--model-step); write the profile JSON.",
        formatter_class=parser.formatter_class,
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory (measured), or for --roofline / --model-step also "
        "a config.json or a preset: llama3-8b, llama3-70b, mixtral-8x7b, qwen3-30b-a3b, "
        "deepseek-v2-lite, deepseek-v3 (default: $PDSERVE_MODEL, else pdserve-stories, as serve)",
    )
    p.add_argument("--out", required=True, help="the profile JSON to write")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--roofline",
        metavar="DEVICE",
        help="no measurement: the model's FLOPs and bytes against a device's stated "
        "peaks: h100, h200, a100, l40s (unset: measured)",
    )
    how.add_argument(
        "--model-step",
        metavar="JSON",
        help="the rates a GPU reached in `python -m pdserve.bench.model_step --json` (unset: measured)",
    )
    p.add_argument(
        "--tensor-parallel-sizes",
        default="1,2,4,8",
        metavar="LIST",
        help="roofline: node sizes (tensor-parallel groups of GPUs) to model, of "
        "which those that hold the model with room for KV are kept (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="roofline: only nodes of this many GPUs (--tensor-parallel-sizes N)",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="--model-step: device memory (no default: required there)",
    )
    p.add_argument(
        "--compute-efficiency",
        type=float,
        default=None,
        help="roofline: share of peak FLOP/s a step reaches (default: 0.6)",
    )
    p.add_argument(
        "--memory-efficiency",
        type=float,
        default=None,
        help="roofline: share of peak bandwidth a step reaches (default: 0.75)",
    )
    p.add_argument("--device", default="cpu", help="measured: cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="measured: default float32 on CPU, else bfloat16")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="measured: torch threads, nodes under `bench` run with 1 (unset: torch's default)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="measured: a node's KV blocks (default: the engine's sizing)",
    )
    p.add_argument(
        "--transport",
        default="tcp",
        choices=("tcp", "shm"),
        help="measured: the KV transport whose transfers are timed",
    )
    p.add_argument(
        "--transfer-gbps",
        type=float,
        default=None,
        help="state the KV transfer bandwidth instead of measuring it (unset: measured; "
        "roofline: 50)",
    )
    p.add_argument(
        "--transfer-latency-ms",
        type=float,
        default=None,
        help="with --transfer-gbps: per transfer (default: 0; roofline: 0.5)",
    )
    p.add_argument(
        "--frontend-ms",
        type=float,
        default=None,
        help="the HTTP front end's share of TTFT (default: 0, or measured with --measure-frontend)",
    )
    p.add_argument(
        "--measure-frontend",
        action="store_true",
        help="measured: start `pdserve serve` and time what HTTP adds to TTFT",
    )
    p.add_argument("--quick", action="store_true", help="measured: a few steps only")


def run(args: argparse.Namespace) -> int:
    if args.tune_command == "profile":
        return run_profile(args)
    return run_search(args)


# --- profile ------------------------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    from pdserve.tune.model_shape import model_shape
    from pdserve.tune.roofline import DEVICES, Assumptions, model_step_profile, roofline_profile
    from pdserve.tune.transfer_model import TransferModel

    efficiency = {
        k: v
        for k, v in (
            ("compute_efficiency", args.compute_efficiency),
            ("memory_efficiency", args.memory_efficiency),
        )
        if v is not None
    }
    if args.transfer_gbps is not None:
        efficiency["transfer_gbps"] = args.transfer_gbps
    if args.transfer_latency_ms is not None:
        efficiency["transfer_latency_s"] = args.transfer_latency_ms / 1e3
    assumptions = Assumptions(**efficiency)
    if args.roofline:
        if args.roofline not in DEVICES:
            raise ValueError(f"--roofline {args.roofline!r}: one of {', '.join(DEVICES)}")
        profile = roofline_profile(
            model_shape(args.model), args.roofline, tp_sizes=_sizes(args), assumptions=assumptions
        )
    elif args.model_step:
        profile = model_step_profile(
            args.model_step,
            model_shape(args.model),
            memory_gb=args.memory_gb,
            assumptions=assumptions,
        )
    else:
        from pdserve.tune.measure import StepGrid, measure_frontend, measure_profile

        transfer = None
        if args.transfer_gbps is not None:
            latency = (args.transfer_latency_ms or 0.0) / 1e3
            transfer = TransferModel(latency, args.transfer_gbps * 1e9, args.transport)
        profile = measure_profile(
            args.model,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            grid=StepGrid.quick() if args.quick else StepGrid(),
            kv_blocks=args.num_kv_blocks,
            transfer=transfer,
            transport=args.transport,
            progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True),
        )
        if args.measure_frontend:
            profile = measure_frontend(profile, args.model)
    if args.frontend_ms is not None:
        from dataclasses import replace

        profile = replace(profile, frontend_s=args.frontend_ms / 1e3)
    profile.save(args.out)
    print(f"wrote {args.out}: {profile.source}")
    print(
        f"  {profile.model.name}: {profile.kv_blocks} KV blocks a node, step "
        f"{json.dumps(profile.step.to_dict())}"
    )
    return 0


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.gpus_per_node is not None:
        text = str(args.gpus_per_node)
    else:
        text = args.tensor_parallel_sizes
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--tensor-parallel-sizes {text!r}: give sizes as 1,2,4,8")
    return sizes


# --- search -------------------------------------------------------------------------------------


def _workload(args: argparse.Namespace):  # noqa: ANN202
    from pdserve.tune.workload import (
        LengthDist,
        load_sharegpt,
        load_trace,
        synthetic,
        token_counter,
    )

    if args.trace:
        return load_trace(args.trace)
    if args.sharegpt:
        model_dir = args.model if args.model and Path(args.model).is_dir() else None
        return load_sharegpt(
            args.sharegpt,
            args.num_requests,
            token_counter(model_dir),
            burstiness=args.burstiness,
            seed=args.seed,
        )
    return synthetic(
        args.num_requests,
        LengthDist.parse(args.prompt_len),
        LengthDist.parse(args.output_len),
        long_fraction=args.long_fraction,
        long_prompt_len=LengthDist.parse(args.long_prompt_len),
        long_output_len=LengthDist.parse(args.long_output_len),
        shared_prefix_len=args.shared_prefix_len,
        burstiness=args.burstiness,
        seed=args.seed,
    )


def run_search(args: argparse.Namespace) -> int:
    from pdserve.tune import provenance
    from pdserve.tune.metrics import summarize
    from pdserve.tune.model_shape import model_shape
    from pdserve.tune.profile import Profile
    from pdserve.tune.report import (
        opening,
        outcome,
        plot_curves,
        search_results,
        serve_command,
        write_outputs,
    )
    from pdserve.tune.search import SearchSpace, curves, search
    from pdserve.tune.simulator import Simulation
    from pdserve.tune.slo import SLO

    missing = [
        f for f in ("profile", "devices", "slo_ttft_ms", "slo_tpot_ms") if getattr(args, f) is None
    ]
    if missing:
        raise ValueError(
            "pdserve tune needs " + ", ".join("--" + m.replace("_", "-") for m in missing)
        )
    profile = Profile.load(args.profile)
    if args.model:
        shape = model_shape(args.model)
        if not shape.same_shape(profile.model):
            raise ValueError(
                f"the profile is of {profile.model.name}'s shape, not {args.model}'s: profile it"
            )
    if not 0 < args.slo_percentile <= 100:
        raise ValueError("--slo-percentile must be in (0, 100]")
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.slo_percentile / 100)
    workload = _workload(args)
    # The simulated nodes and coordinator log as the real ones do: registrations, and so on.
    for name in ("coordinator", "prefill_node", "decode_node", "engine", "kv_transfer"):
        logging.getLogger(f"pdserve.{name}").setLevel(logging.WARNING)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if not args.no_progress else None
    results = provenance.start(["pdserve", *getattr(args, "argv", sys.argv[1:])]) | {
        "profile": profile.source,
        "num_requests": len(workload),
        "workload": workload.description,
        "mean_prompt_len": workload.mean_prompt_len,
        "mean_output_len": workload.mean_output_len,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "devices": args.devices,
        "tp_sizes": profile.tp_sizes,
        "gpus_per_host": args.gpus_per_host,
    }
    print(opening(results))
    space = SearchSpace.quick() if args.quick else SearchSpace()
    result = search(
        profile,
        workload,
        slo,
        args.devices,
        space=space,
        processes=args.processes,
        progress=say,
        gpus_per_host=args.gpus_per_host,
    )
    top = result.ranked[: args.top]
    at = None
    if args.rate:
        at = {}
        for e in top:
            run = Simulation(e.deployment, profile).run(workload.at_rate(args.rate))
            at[e.deployment] = summarize(run.outcomes, slo, args.rate)
    results |= search_results(result, args.top, at, args.rate)
    # CPU time of the search, its simulation processes included (they have ended: joined).
    used = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    results["cpu_seconds"] = sum(u.ru_utime + u.ru_stime for u in used)
    results["warning"] = _warning(top, workload, slo, result.best.goodput)
    # At the winner's goodput: how long the requests take to arrive, and what a request of the
    # mean output length may take within the SLO (the warning's figures).
    span = _arrival_span(workload, slo, result.best.goodput)
    results["arrivals_span_s"], results["request_budget_s"] = span or (None, None)
    out = Path(args.out_dir)
    best = result.best
    written = write_outputs(
        best, profile, slo, args.devices, out, _served_model(args.model), args.gpus_per_host
    )
    if not args.no_plot:
        shown = result.ranked[:2]
        runs = curves(
            profile,
            workload,
            slo,
            shown,
            result.devices,
            space.screen_nodes,
            processes=args.processes,
        )
        title = (
            f"{profile.model.name} on {args.devices} devices ({profile.device}); "
            f"{profile.source.split(':')[0]} profile; simulated on a slice of "
            f"{space.screen_nodes} nodes, rates scaled"
        )
        plot = plot_curves(runs, slo, out / "goodput.png", title)
        if plot is not None:
            written.append(plot)
    written.append(out / "tune.json")
    results["serve_command"] = serve_command(best.deployment, str(out / "pdserve.toml"))
    results["written"] = [str(p) for p in written]
    results = provenance.finish(results)
    (out / "tune.json").write_text(json.dumps(results, indent=1) + "\n")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + outcome(results))
    return 0


def _warning(top, workload, slo, goodput: float) -> str | None:  # noqa: ANN001
    """The search's warning: a deployment that absorbed the workload as one burst, or arrivals
    too short at the winner's goodput to measure a sustained rate; None when neither."""
    from pdserve.tune.search import CEILING

    if any(e.burst for e in top):
        return (
            f">= marks a deployment that met the SLO even at {CEILING:g} times its "
            f"throughput bound: {len(workload)} requests arrive as one burst it absorbs; give "
            "more requests (--num-requests) to measure a sustained rate"
        )
    if (short := _short_span(workload, slo, goodput)) is not None:
        span, typical = short
        return (
            f"at {goodput:.3g} req/s the {len(workload)} requests arrive "
            f"over {span:.0f} s, less than 3 times the {typical:.0f} s a request of mean length "
            "may take within the SLO: a queue that grows slowly never reaches the target, which "
            "favours deployments bound by a queue (prefill); give more requests "
            "(--num-requests) for a sustained rate"
        )
    return None


def _arrival_span(workload, slo, rate: float) -> tuple[float, float] | None:  # noqa: ANN001
    """(span, typical): how long the workload's arrivals at `rate` take, and what a request of
    the mean output length may take within the SLO; None without a rate or two requests."""
    if rate <= 0 or len(workload) < 2:
        return None
    span = float(workload.offsets[-1] - workload.offsets[0]) / rate
    typical = slo.ttft_s + slo.tpot_s * max(0.0, workload.mean_output_len - 1)
    return span, typical


def _short_span(workload, slo, rate: float) -> tuple[float, float] | None:  # noqa: ANN001
    """(span, typical) when the workload's arrivals at `rate` span less than 3 times what a
    request of the mean output length may take within the SLO (over a rate the deployment cannot
    sustain, a batch fills and a queue grows over about that long); else None."""
    found = _arrival_span(workload, slo, rate)
    return found if found is not None and found[0] < 3 * found[1] else None


def _served_model(model: str | None) -> str | None:
    """What the cluster file names as its model: an embedded model's name or the checkpoint's
    directory; None (the nodes' default) for a preset or none given."""
    from pdserve.engine.embedded.catalog import EMBEDDED

    if model is None or model in EMBEDDED:
        return model
    path = Path(model).expanduser().resolve()
    if path.is_file():  # a config.json: its checkpoint directory
        path = path.parent
    return str(path) if path.is_dir() else None
