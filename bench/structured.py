"""What a structured-output constraint costs, side by side in one run on the offline engine:

- throughput of the same requests with and without a JSON-schema constraint of the kind
  applications send (a title, a story of at most 300 characters, a few tags), rounds
  alternating; each unconstrained request writes exactly as many tokens as its constrained twin
  (its max_tokens set to that, ignoring end-of-sequence), so both do the same work;
- the compile time of small and large schemas (the first compile of a node builds its tokenizer
  information as well), and of a cached one;
- forced tokens (`forced_tokens`) off and on, for a strict schema (fixed keys, enums, a bounded
  name): output tokens per forward of a sequence (each sampled token takes one; a forced one
  none), steps, throughput, rounds alternating, and whether the outputs are the same.

    python -m pdserve.bench.structured
    python -m pdserve.bench.structured --requests 64 --max-tokens 128 --rounds 3 --json-out s.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pdserve.bench.peers import models as bench_models
from pdserve.cluster.structured_output import StructuredOutput
from pdserve.engine import LLM, SamplingParams
from pdserve.tune import provenance

APP_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "maxLength": 300},
        "tags": {
            "type": "array",
            "items": {"enum": ["cat", "dog", "bird", "river", "ball"]},
            "maxItems": 3,
        },
    },
    "required": ["title", "story", "tags"],
    "additionalProperties": False,
}
STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["girl", "boy", "cat", "dog", "bird"]},
        "home": {"enum": ["park", "garden", "forest", "house", "school"]},
        "happy": {"type": "boolean"},
        "friends": {"type": "array", "items": {"enum": ["Tom", "Lily", "Sam"]}, "maxItems": 2},
    },
    "required": ["name", "kind", "home", "happy", "friends"],
    "additionalProperties": False,
}
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def large_schema(fields: int = 60) -> dict:
    """An object of many typed fields, nested arrays of objects among them."""
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tag": {"type": "string"}},
                "required": ["id"],
            },
        },
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)[: fields // 2]}


def throughput(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / (time.perf_counter() - start), tokens


def forced_tokens(model: str, prompts: list[str], max_tokens: int, rounds: int) -> dict:
    """STRICT_SCHEMA with forced tokens off and on: an engine each, the same requests."""
    spec = StructuredOutput.json_schema(STRICT_SCHEMA)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, structured=spec)
        for i in range(len(prompts))
    ]
    engines = {
        name: LLM(model, num_kv_blocks=4096, block_size=16, forced_tokens=on)
        for name, on in (("off", False), ("on", True))
    }
    outputs = {}
    for name, llm in engines.items():  # warm up; the outputs to compare
        outputs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    table: dict = {name: [] for name in engines}
    for r in range(rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            stats = engines[name].engine.stats
            before = (stats.num_steps, stats.num_forced_tokens)
            rate, tokens = throughput(engines[name], prompts, params)
            steps, forced = stats.num_steps - before[0], stats.num_forced_tokens - before[1]
            table[name].append(
                {
                    "tokens_per_s": round(rate, 1),
                    "tokens": tokens,
                    "steps": steps,
                    "forced": forced,
                    "tokens_per_forward": round(tokens / (tokens - forced), 3),
                }
            )
    for llm in engines.values():
        llm.close()
    return {
        "schema": STRICT_SCHEMA,
        "same_outputs": outputs["off"] == outputs["on"],
        "rounds": table,
        "speedup": round(
            statistics.median(
                on["tokens_per_s"] / off["tokens_per_s"]
                for on, off in zip(table["on"], table["off"])
            ),
            3,
        ),
    }


def compile_ms(llm: LLM, schema: dict) -> float:
    spec = StructuredOutput.json_schema(schema)
    start = time.perf_counter()
    llm.engine.grammars.request(spec).result()
    return round((time.perf_counter() - start) * 1e3, 2)


COMPILE_LABELS = {
    "first (builds the tokenizer information)": "the first of a node (builds the tokenizer "
    "information)",
    "small schema": "a small schema (2 properties)",
    "large schema (60 fields)": "a large schema (60 fields)",
    "small schema again (cached)": "the small schema again (cached)",
}


def _model(results: dict) -> str:
    return results["settings"]["model"]


def ratio_table(*results: dict) -> str:
    """The docs' table of throughput with and without the constraint, a row per results file."""
    rows = [
        "| model | requests | tokens | tok/s without, per round | tok/s with, per round "
        "| with / without (median) |",
        "| --- | ---: | ---: | --- | --- | ---: |",
    ]

    def per_round(r: dict, kind: str) -> str:
        return " / ".join(f"{x[kind]['tokens_per_s']:,.0f}" for x in r["rounds"])

    for r in results:
        rows.append(
            f"| {_model(r)} | {r['settings']['requests']} | {r['rounds'][0]['with']['tokens']:,} "
            f"| {per_round(r, 'without')} | {per_round(r, 'with')} "
            f"| {r['ratio_with_over_without']:.2f} |"
        )
    return "\n".join(rows)


def forced_table(*results: dict) -> str:
    """The docs' table of forced tokens off and on (the strict schema), two rows per file."""
    rows = [
        "| forced tokens, strict schema | tokens per forward | steps | tok/s, median of "
        f"{len(results[0]['forced_tokens']['rounds']['off'])} rounds | on / off (median) "
        "| outputs |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        forced = r["forced_tokens"]
        for name, measured in forced["rounds"].items():
            med = {k: statistics.median(x[k] for x in measured) for k in measured[0]}
            ratio = f"{forced['speedup']:.2f}" if name == "on" else ""
            same = ("the same" if forced["same_outputs"] else "differ") if name == "on" else ""
            rows.append(
                f"| {_model(r)}, {name} | {med['tokens_per_forward']:.2f} | {med['steps']:.0f} "
                f"| {med['tokens_per_s']:,.0f} | {ratio} | {same} |"
            )
    return "\n".join(rows)


def compile_table(*results: dict) -> str:
    """The docs' table of grammar compile times, a column per results file."""

    def ms(x: float) -> str:
        return f"{x:.2f}" if x < 1 else f"{x:.1f}"

    rows = [
        "| compile | " + " | ".join(f"{_model(r)} ms" for r in results) + " |",
        "| --- |" + " ---: |" * len(results),
    ]
    for key in results[0]["compile_ms"]:
        cells = " | ".join(ms(r["compile_ms"][key]) for r in results)
        rows.append(f"| {COMPILE_LABELS.get(key, key)} | {cells} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--model",
        default="pdserve-stories",
        help="pdserve-stories, a bench model (llama-9m, llama-50m, qwen3-25m) or a "
        "checkpoint directory",
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    record = provenance.start(
        sys.argv if argv is None else ["python", "-m", "pdserve.bench.structured", *argv]
    )
    results: dict = {"settings": {k: str(v) for k, v in vars(args).items()}}
    model = (
        args.model if args.model.startswith("pdserve-") else str(bench_models.resolve(args.model))
    )
    llm = LLM(model, num_kv_blocks=4096, block_size=16)
    first = compile_ms(llm, {"type": "object"})  # the tokenizer information, built once
    compiles = {
        "first (builds the tokenizer information)": first,
        "small schema": compile_ms(llm, SMALL_SCHEMA),
        "large schema (60 fields)": compile_ms(llm, large_schema()),
        "small schema again (cached)": compile_ms(llm, SMALL_SCHEMA),
    }
    prompts = [f"Once upon a time there was a cat number {i}." for i in range(args.requests)]
    spec = StructuredOutput.json_schema(APP_SCHEMA)
    constrained = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, structured=spec)
        for i in range(len(prompts))
    ]
    lengths = [len(o.token_ids) for o in llm.generate(prompts, constrained)]  # (warms up too)
    free = [
        SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    throughput(llm, prompts, free)  # warm too: the row counts its steps meet
    rounds = []
    for r in range(args.rounds):
        order = [("without", free), ("with", constrained)]
        row = {}
        for name, params in order if r % 2 == 0 else order[::-1]:
            rate, tokens = throughput(llm, prompts, params)
            row[name] = {"tokens_per_s": round(rate, 1), "tokens": tokens}
        rounds.append(row)
        print(
            f"round {r + 1}: without {row['without']['tokens_per_s']} tok/s "
            f"({row['without']['tokens']} tokens), with {row['with']['tokens_per_s']} tok/s "
            f"({row['with']['tokens']} tokens)"
        )
    ratio = statistics.median(
        r["with"]["tokens_per_s"] / r["without"]["tokens_per_s"] for r in rounds
    )
    results.update(compile_ms=compiles, rounds=rounds, ratio_with_over_without=round(ratio, 3))
    forced = forced_tokens(model, prompts, args.max_tokens, args.rounds)
    results["forced_tokens"] = forced
    results = provenance.finish(record) | results
    print(f"\n{ratio_table(results)}\n\n{forced_table(results)}\n\n{compile_table(results)}")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if forced["same_outputs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
