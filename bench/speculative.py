"""Speculative decoding (n-gram lookup) against plain decoding, side by side in one run: for each
workload and batch size, the decode phase's time per output token and tokens per second with
speculation off and on, alternating, the best of `--repeats` each, and the acceptance.

    python -m pdserve.bench.speculative                       # the workloads below, batch 1, 8, 32
    python -m pdserve.bench.speculative --batches 1 --json spec.json

Workloads (prompts of random token ids, every request `--max-tokens` long, no early stop):
- `loops` (llama-50m, random weights, greedy): a random model's greedy outputs fall into cycles
  that repeat earlier tokens, so the lookup finds its continuations, as it does where an output
  copies its prompt (code editing, quoting answers);
- `sampled` (the same model, temperature 1, seeded): nothing repeats, so the lookup finds little,
  and what it costs is what is measured;
- `stories` (pdserve-stories, greedy, story openings): trained text, which repeats names and
  phrases now and then.

Both sides of a pair are the same engine settings but `speculative_config` and produce the same
tokens (checked: the run fails if they differ). Timing covers the decode phase only: from the step
after which every request has its first token to the last step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.offline_throughput import machine
from pdserve.bench.peers import models as bench_models
from pdserve.engine import LLM, SamplingParams

WORKLOADS = {
    # name: (model, temperature)
    "loops": ("llama-50m", 0.0),
    "sampled": ("llama-50m", 1.0),
    "stories": ("pdserve-stories", 0.0),
}
OPENINGS = [
    "Once upon a time",
    "One day, Tom went to the park.",
    "Lily had a red ball.",
    "Where is the cat?",
]


@dataclass(frozen=True, slots=True)
class Run:
    workload: str
    batch: int
    speculative: bool
    tpot_ms: float  # decode phase: seconds per step of output, per request
    decode_tokens_per_s: float
    steps: int
    draft_tokens: int
    accepted_tokens: int


def prompts_for(workload: str, llm: LLM, batch: int, prompt_len: int, seed: int) -> list:
    if workload == "stories":
        return [llm.tokenizer.encode(OPENINGS[i % len(OPENINGS)]) for i in range(batch)]
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    return [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def decode_phase(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, list]:
    """Seconds from every request's first token to the last step, and the outputs."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    tokens = {rid: [] for rid in ids}
    start = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if start is None and all(tokens.values()):
            start = time.perf_counter()
    return time.perf_counter() - start, [tokens[rid] for rid in ids]


def measure(args: argparse.Namespace, workload: str, batch: int) -> list[Run]:
    model, temperature = WORKLOADS[workload]
    path = model if model.startswith("pdserve-") else str(bench_models.resolve(model))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k})
    llms = {
        on: LLM(
            path,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=max(batch, 1),
            speculative_config=spec if on else None,
        )
        for on in (False, True)
    }
    prompts = prompts_for(workload, llms[False], batch, args.prompt_len, args.seed)
    params = [
        SamplingParams(
            max_tokens=args.max_tokens, temperature=temperature, seed=args.seed + i, ignore_eos=True
        )
        for i in range(batch)
    ]
    for llm in llms.values():  # warm-up
        decode_phase(llm, prompts[:1], [SamplingParams(max_tokens=4, temperature=0)])
    best: dict[bool, Run] = {}
    outputs: dict[bool, list] = {}
    order = [False, True]
    for repeat in range(args.repeats):
        for on in order if repeat % 2 == 0 else order[::-1]:
            stats = llms[on].engine.stats
            steps, drafts, accepted = (
                stats.num_steps,
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
            )
            seconds, outs = decode_phase(llms[on], prompts, params)
            outputs[on] = outs
            decoded = sum(len(o) - 1 for o in outs)
            run = Run(
                workload,
                batch,
                on,
                tpot_ms=seconds / (args.max_tokens - 1) * 1e3,
                decode_tokens_per_s=decoded / seconds,
                steps=stats.num_steps - steps,
                draft_tokens=stats.num_draft_tokens - drafts,
                accepted_tokens=stats.num_accepted_tokens - accepted,
            )
            if on not in best or run.tpot_ms < best[on].tpot_ms:
                best[on] = run
    if outputs[True] != outputs[False]:
        raise SystemExit(f"{workload} batch {batch}: speculation changed the tokens")
    return [best[False], best[True]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.speculative", description=__doc__.split("\n")[0]
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="the engines' dtype (auto: the device's)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    runs = []
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            raise SystemExit(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        for batch in (int(b) for b in args.batches.split(",")):
            runs += measure(args, workload, batch)
    result = {
        "command": "python -m pdserve.bench.speculative " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": [asdict(r) for r in runs],
    }
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def render(result: dict) -> str:
    lines = [
        "| workload | batch | TPOT ms plain | TPOT ms spec | speed-up | decode tok/s plain | "
        "decode tok/s spec | steps plain / spec | accepted / drafts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    runs = result["runs"]
    for plain, spec in zip(runs[::2], runs[1::2]):
        rate = spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else 0.0
        lines.append(
            f"| {plain['workload']} | {plain['batch']} | {plain['tpot_ms']:.2f} | "
            f"{spec['tpot_ms']:.2f} | {plain['tpot_ms'] / spec['tpot_ms']:.2f}x | "
            f"{plain['decode_tokens_per_s']:.0f} | {spec['decode_tokens_per_s']:.0f} | "
            f"{plain['steps']} / {spec['steps']} | {spec['accepted_tokens']} / "
            f"{spec['draft_tokens']} ({rate:.0%}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
