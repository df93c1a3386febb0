"""Speculative decoding (n-gram lookup, or a draft model) against plain decoding, side by side in
one run: for each workload and batch size, the decode phase's time per output token and tokens per
second with speculation off and on, alternating, the best of `--repeats` each, and the acceptance.

    python -m pdserve.bench.speculative                       # the workloads below, batch 1, 8, 32
    python -m pdserve.bench.speculative --batches 1 --json-out spec.json
    python -m pdserve.bench.speculative --method draft_model --draft-layers 1   # a draft model

`--method draft_model` drafts with `--draft` (a checkpoint directory or an embedded model's name of
the target's vocabulary), or by default with the target's own first `--draft-layers` layers (its
embedding, final norm and head kept), written to a temporary directory: a draft that agrees with
the target often but not always, and costs a fraction of its layers (not of its head).

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
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.peers import models as bench_models
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.models.weights import checkpoint_files
from pdserve.tune import provenance

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
    model: str = ""  # the target's directory or name


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


def first_layers_checkpoint(model_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """A draft of a checkpoint: its first num_layers layers and everything else of it (embedding,
    final norm, head, tokenizer), so it has the target's vocabulary by construction."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers: the target has {config['num_hidden_layers']} layers")
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for file in checkpoint_files(model_dir):
        for name, tensor in load_file(str(file)).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                kept[name] = tensor
    save_file(kept, str(out_dir / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            (out_dir / name).write_bytes((model_dir / name).read_bytes())
    return out_dir


def speculative_config(args: argparse.Namespace, target: str, scratch: Path) -> str:
    config: dict = {"method": args.method, "num_speculative_tokens": args.k}
    if args.disable_by_batch_size is not None:
        config["disable_by_batch_size"] = args.disable_by_batch_size
    if args.method == "ngram":
        return json.dumps(config)
    draft = args.draft
    if draft is None:
        out = scratch / f"{Path(target).name}-first-{args.draft_layers}"
        draft = str(first_layers_checkpoint(resolve_model_dir(target), out, args.draft_layers))
    return json.dumps({**config, "model": draft})


def measure(
    args: argparse.Namespace, workload: str, batch: int, scratch: Path
) -> tuple[list[Run], list[Run]]:
    """The best plain and speculative runs of the pair, and every run."""
    model, temperature = WORKLOADS[workload]
    model = args.target or model
    path = model if model.startswith("pdserve-") else str(bench_models.resolve(model))
    spec = speculative_config(args, path, scratch)
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
    every: list[Run] = []
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
            draft_cache = getattr(llms[on].engine.proposer, "block_manager", None)
            if draft_cache is not None:
                # Each run catches the draft up with its prompts as new requests do, not from
                # the draft's prefix cache of the warm-up and earlier repeats.
                draft_cache.reset_prefix_cache()
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
                model=path,
            )
            every.append(run)
            if on not in best or run.tpot_ms < best[on].tpot_ms:
                best[on] = run
    if outputs[True] != outputs[False]:
        raise SystemExit(f"{workload} batch {batch}: speculation changed the tokens")
    return [best[False], best[True]], every


def describe_model(name: str) -> dict:
    """A model the run names: its directory, parameter count and, for one trained by
    `pdserve.bench.stories.train`, its shape and recipe (so the figure names how it was made)."""
    from safetensors import safe_open

    path = resolve_model_dir(name) if name.startswith("pdserve-") else bench_models.resolve(name)
    parameters = 0
    for file in checkpoint_files(path):
        with safe_open(str(file), "pt") as f:
            parameters += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    out = {"path": str(path), "parameters": parameters}
    training = path / "training.json"
    if training.is_file():
        record = json.loads(training.read_text())
        out["training"] = {k: record.get(k) for k in ("shape", "recipe", "seconds", "final_loss")}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.speculative", description=__doc__.split("\n")[0]
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    p.add_argument("--draft", default=None, help="draft_model: the draft (unset: --draft-layers)")
    p.add_argument(
        "--draft-layers", type=int, default=1, help="draft_model: the target's first N layers"
    )
    p.add_argument(
        "--target",
        default=None,
        help="every workload's target model (a checkpoint directory or a model's name; unset: "
        "each workload's own), e.g. one trained with pdserve.bench.stories.train",
    )
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="the speculative config's disable_by_batch_size (unset: speculate at any batch)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="the engines' dtype (auto: the device's)")
    p.add_argument("--json-out", "--json", type=Path, default=None, help="the results file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    record = provenance.start(sys.argv if argv is None else [__file__, *argv])
    # Described first: a model named wrongly fails here, not after the whole run.
    models = {
        role: describe_model(name)
        for role, name in (("target", args.target), ("draft", args.draft))
        if name
    }
    runs, rounds = [], []
    with tempfile.TemporaryDirectory(prefix="pdserve-drafts-") as scratch:
        for workload in args.workloads.split(","):
            if workload not in WORKLOADS:
                raise SystemExit(
                    f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}"
                )
            for batch in (int(b) for b in args.batches.split(",")):
                best, every = measure(args, workload, batch, Path(scratch))
                runs += best
                rounds += every
    result = provenance.finish(record) | {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "models": models,
        "runs": [
            asdict(r) for r in runs
        ],  # the best of each pair's repeats, plain then speculative
        "rounds": [asdict(r) for r in rounds],  # every repeat
    }
    print(docs_table(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def docs_table(result: dict, rates: str = "true") -> str:
    """Plain against speculative, workload by workload: TPOT, the speed-up, (unless
    `rates=false`) decode tokens/s, steps and the drafts accepted of those verified."""
    show_rates = rates != "false"
    head = "| workload | batch | TPOT ms plain | TPOT ms speculative | speed-up |"
    head += " decode tok/s plain | decode tok/s speculative |" if show_rates else ""
    cols = 9 if show_rates else 7
    lines = [
        head + " steps plain / speculative | drafts accepted |",
        "| --- |" + " ---: |" * (cols - 1),
    ]
    runs = result["runs"]
    for plain, spec in zip(runs[::2], runs[1::2]):
        speedup = plain["tpot_ms"] / spec["tpot_ms"]
        rates_cells = (
            f" {plain['decode_tokens_per_s']:.0f} | {spec['decode_tokens_per_s']:.0f} |"
            if show_rates
            else ""
        )
        drafts = spec["draft_tokens"]
        accepted = (
            f"{spec['accepted_tokens']:,} of {drafts:,} ({spec['accepted_tokens'] / drafts:.0%})"
            if drafts
            else "none proposed"
        )
        lines.append(
            f"| {plain['workload']} | {plain['batch']} | {plain['tpot_ms']:.2f} | "
            f"{spec['tpot_ms']:.2f} | {speedup:.2f}x |{rates_cells} "
            f"{plain['steps']} / {spec['steps']} | {accepted} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
