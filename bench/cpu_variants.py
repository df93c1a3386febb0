"""Engine variants on CPU side by side: one seeded offline workload (as bench.offline_throughput
makes it) through pdserve continuous with different engine settings, each run in a fresh process,
the variants alternating round by round; prints each variant's output tokens/s per round and their
median, and the machine's load. `--load N` runs N busy-loop processes for the whole run (a
competing load: one per core takes every core).

    .venv/bin/python -m pdserve.bench.cpu_variants --variant t2=cpu_threads:2 \\
        --variant t1-bound=cpu_threads:1,cpu_bind:0 --rounds 3 --load 2 --json-out out.json

A variant is NAME=KEY:VALUE,KEY:VALUE... of EngineConfig settings (values as TOML would read
them: 1, true, text).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve import SOURCE_ROOT
from pdserve.bench.offline_throughput import (
    blocks_for,
    kv_manager,
    make_workload,
    model_config,
    write_model,
)
from pdserve.bench.peers.models import num_parameters
from pdserve.tune import provenance

ROOT = Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True:\n    pass\n"


def parse_variant(text: str) -> tuple[str, dict]:
    name, eq, body = text.partition("=")
    if not eq or not name:
        raise ValueError(f"a variant is NAME=KEY:VALUE,...: got {text!r}")
    settings: dict = {}
    for item in filter(None, body.split(",")):
        key, colon, value = item.partition(":")
        if not colon:
            raise ValueError(f"variant {name}: {item!r} is not KEY:VALUE")
        settings[key] = _value(key, value)
    return name, settings


def _value(key: str, text: str) -> object:
    """The text as the EngineConfig setting `key` holds it."""
    from pdserve.cluster.schema import declared
    from pdserve.engine.config import EngineConfig

    kinds = {d.name: d.kind for d in declared(EngineConfig)}
    if key not in kinds:
        raise ValueError(f"{key!r} is no engine setting")
    if kinds[key] is bool:
        return text == "true"
    return kinds[key](text.strip('"'))


def child(spec: dict) -> dict:
    """One variant's run in this process: warm up, then the whole workload at once."""
    from pdserve.engine import LLM, SamplingParams

    args = argparse.Namespace(**spec["workload"])
    workload = make_workload(args)
    start_build = time.perf_counter()
    llm = LLM(
        spec["model_dir"],
        num_kv_blocks=blocks_for(
            [len(r.prompt) + r.output_len for r in workload],
            kv_manager(Path(spec["model_dir"]), 16),
        ),
        dtype="float32",
        device="cpu",
        enable_prefix_caching=False,
        **spec["settings"],
    )
    build_s = time.perf_counter() - start_build
    engine = llm.engine
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for run in range(2 if spec["warm_workload"] else 1):  # the first of two compiles its shapes
        start = time.perf_counter()
        for i, r in enumerate(workload):
            params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
            engine.add_request(f"bench-{run}-{i}", r.prompt, params)
        produced = 0
        while engine.has_unfinished():
            produced += len(engine.step())
        elapsed = time.perf_counter() - start
    import torch

    return {
        "tokens_per_s": produced / elapsed,
        "elapsed_s": elapsed,
        "build_s": build_s,
        "threads": torch.get_num_threads(),
        "cores": sorted(os.sched_getaffinity(0)),
        "load_1m": os.getloadavg()[0],
    }


def run_child(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(SOURCE_ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.cpu_variants", "--child", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"variant {spec['name']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", action="append", default=[], help="NAME=KEY:VALUE,...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="busy-loop processes during the run")
    p.add_argument(
        "--warm-workload",
        action="store_true",
        help="run the workload once untimed before the timed run (compiled shapes warm)",
    )
    w = p.add_argument_group("workload (as bench.offline_throughput)")
    w.add_argument("--num-requests", type=int, default=48)
    w.add_argument("--min-prompt-len", type=int, default=16)
    w.add_argument("--max-prompt-len", type=int, default=160)
    w.add_argument("--min-output-len", type=int, default=16)
    w.add_argument("--max-output-len", type=int, default=160)
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model (random weights, Llama-shaped, float32)")
    m.add_argument("--hidden-size", type=int, default=512)
    m.add_argument("--layers", type=int, default=6)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=4)
    m.add_argument("--intermediate-size", type=int, default=1536)
    m.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--json-out", type=Path, default=None)
    return p.parse_args(argv)


WORKLOAD_KEYS = (
    "num_requests",
    "min_prompt_len",
    "max_prompt_len",
    "min_output_len",
    "max_output_len",
    "seed",
    "vocab_size",
)


def docs_table(results: dict, compare: str = "true") -> str:
    """Each variant's output tokens/s per round, their median and, unless `compare=false`, the
    median over the first variant's."""
    variants = results["variants"]
    first = next(iter(variants.values()))["median"]
    vs = compare != "false"
    head = "| variant | tok/s per round | median |" + (
        f" vs {next(iter(variants))} |" if vs else ""
    )
    lines = [head, "| --- | --- | ---: |" + (" ---: |" if vs else "")]
    for name, v in variants.items():
        line = (
            f"| {name} | {', '.join(f'{x:.0f}' for x in v['tokens_per_s'])} | {v['median']:.0f} |"
        )
        lines.append(line + (f" {v['median'] / first:.2f}x |" if vs else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return None
    variants = [parse_variant(v) for v in args.variant] or [("default", {})]
    cfg = model_config(args)
    workload = {k: getattr(args, k) for k in WORKLOAD_KEYS}
    record = provenance.start(sys.argv if argv is None else [__file__, *argv])
    print(f"command: {record['command']}")
    print(
        f"model: {num_parameters(cfg) / 1e6:.1f}M parameters, float32; load: {args.load} "
        f"busy-loop processes"
    )
    # Stopped by a signal, the run still stops its load (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load)]
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-cpu-variants-") as tmp:
            model_dir = Path(tmp) / "model"
            model_dir.mkdir()
            write_model(model_dir, cfg, args.seed)
            for r in range(args.rounds):
                for name, settings in variants:
                    spec = {
                        "name": name,
                        "model_dir": str(model_dir),
                        "settings": settings,
                        "workload": workload,
                        "warm_workload": args.warm_workload,
                    }
                    res = run_child(spec)
                    results[name].append(res)
                    print(
                        f"round {r + 1} {name}: {res['tokens_per_s']:.0f} tok/s "
                        f"({res['threads']} threads on cores {res['cores']}, "
                        f"load {res['load_1m']:.2f})",
                        flush=True,
                    )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    summary = {
        name: {
            "settings": settings,
            "tokens_per_s": [x["tokens_per_s"] for x in results[name]],
            "median": statistics.median(x["tokens_per_s"] for x in results[name]),
            "rounds": results[name],
        }
        for name, settings in variants
    }
    out = provenance.finish(record) | {
        "competing_load": args.load,
        "model_parameters": num_parameters(cfg),
        "variants": summary,
    }
    print("\n" + docs_table(out))
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
