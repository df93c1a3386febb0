"""What a roofline profile (`pdserve tune profile --roofline`) predicts for single steps at each
node size it models: KV room, step times and their parts, the figures docs/tuning.md quotes.

    python -m pdserve.bench.roofline_steps --model deepseek-v2-lite --device h100 \\
        --decode 128:3000 --prefill 1:2670 --prefill 1:8192:chunk \\
        --json-out bench/results/roofline_v2lite_h100.json

It times nothing: every figure is the roofline's (stated peaks times assumed efficiencies).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.tune import provenance
from pdserve.tune.model_shape import model_shape
from pdserve.tune.profile import Profile
from pdserve.tune.roofline import TP_SIZES, Assumptions, roofline_profile
from pdserve.tune.step_model import StepShape


def step_parts(profile: Profile, kind: str, count: int, length: int, word: str = "") -> dict:
    """One step's modeled time and its parts: context (KV or latent) reads, the per-token
    matmul FLOPs, the all-reduces' fixed latencies and their bytes; for a prefill, the KV
    handoff of its prompts."""
    shape = (
        StepShape.decode(count, length) if kind == "decode" else StepShape.prefill(count, length)
    )
    step = profile.step
    overhead = Assumptions().step_overhead_s
    parts = {
        "kind": kind,
        "count": count,
        "length": length,
        "word": word,
        "seconds": step.time(shape),
        "context_read_s": step.per_context_s * shape.num_context,
        "matmul_s": step.per_token_s * shape.num_tokens,
        "allreduce_latency_s": max(0.0, step.base_s - overhead),
        "allreduce_bytes_s": step.allreduce_per_token_s * shape.num_tokens,
    }
    if kind == "prefill":
        blocks = -(-length // profile.block_size)
        parts["transfer_wire_s"] = profile.transfer.wire_time(blocks * profile.kv_bytes_per_block)
        parts["transfer_latency_s"] = profile.transfer.latency_s
    return parts


def node_steps(profile: Profile, decodes: list[tuple], prefills: list[tuple]) -> list[dict]:
    """Each node size's KV room and steps."""
    out = []
    for size in profile.tp_sizes:
        at = profile.at_tp(size)
        out.append(
            {
                "size": size,
                "kv_blocks": at.kv_blocks,
                "kv_tokens": at.kv_blocks * at.block_size,
                "steps": [step_parts(at, "decode", *d) for d in decodes]
                + [step_parts(at, "prefill", *f) for f in prefills],
            }
        )
    return out


def _step_label(s: dict) -> str:
    if s["kind"] == "decode":
        seqs = "1 sequence" if s["count"] == 1 else f"{s['count']} sequences"
        tokens = "1 token" if s["length"] == 1 else f"{s['length']:,} tokens"
        return f"decode step: {seqs} at {tokens}"
    word = s.get("word") or "prompt"
    if s["count"] == 1:
        return f"one {s['length']:,}-token {word}"
    return f"{s['count']} {word}s of {s['length']:,} tokens"


def docs_table(results: dict) -> str:
    """A row per node size: KV room, each step's time, and for each decode its context reads
    (the latent's, with MLA)."""
    reads = "latent reads" if results["mla"] else "KV reads"
    first = results["nodes"][0]["steps"]
    head = ["node", "KV room (tokens)"]
    for s in first:
        head.append(_step_label(s))
        if s["kind"] == "decode":
            head.append(f"of which {reads}")
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for node in results["nodes"]:
        name = (
            f"1 {results['roofline_device'].upper()}" if node["size"] == 1 else f"TP {node['size']}"
        )
        cells = [name, f"{node['kv_tokens']:,}"]
        for s in node["steps"]:
            cells.append(f"{s['seconds'] * 1e3:.1f} ms")
            if s["kind"] == "decode":
                cells.append(f"{s['context_read_s'] * 1e3:.1f} ms")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _pair(text: str) -> tuple[int, int, str]:
    """COUNT:LENGTH[:WORD], WORD naming a prefill's tokens in the table (default: prompt)."""
    count, length, *word = text.split(":")
    return int(count), int(length), word[0] if word else "prompt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.roofline_steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="a preset or a config.json, as tune profile")
    p.add_argument("--device", required=True, help="h100, h200, a100 or l40s")
    p.add_argument("--tensor-parallel-sizes", default=",".join(map(str, TP_SIZES)))
    p.add_argument("--decode", type=_pair, action="append", default=[], metavar="SEQS:CONTEXT")
    p.add_argument(
        "--prefill", type=_pair, action="append", default=[], metavar="PROMPTS:LENGTH[:WORD]"
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    record = provenance.start(sys.argv)
    shape = model_shape(args.model)
    sizes = [int(x) for x in args.tensor_parallel_sizes.split(",")]
    profile = roofline_profile(shape, args.device, tp_sizes=sizes)
    results = provenance.finish(record) | {
        "model": shape.name,
        "roofline_device": args.device,
        "mla": shape.is_mla,
        "parameters": shape.num_params,
        "weight_bytes": shape.weight_bytes(profile.dtype),
        "kv_bytes_per_token": shape.kv_bytes_per_token(profile.dtype),
        "transfer_gbps_per_gpu": Assumptions().transfer_gbps,
        "profile": profile.source,
        "nodes": node_steps(profile, args.decode, args.prefill),
    }
    print(docs_table(results))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _step(node: dict, kind: str, count: int, length: int) -> dict:
    return next(
        s for s in node["steps"] if (s["kind"], s["count"], s["length"]) == (kind, count, length)
    )


def _sizes(results: dict) -> str:
    return " and ".join(f"TP {n['size']}" for n in results["nodes"])


def allreduce_sentence(results: dict, decode: str, prefill: str) -> str:
    """The all-reduces' share of a decode step and of a prefill, at each node size."""
    seqs, context = map(int, decode.split(":"))
    prompts, length = map(int, prefill.split(":"))
    nodes = results["nodes"]
    d = [_step(n, "decode", seqs, context) for n in nodes]
    f = [_step(n, "prefill", prompts, length) for n in nodes]
    sizes = [n["size"] for n in nodes]

    def each(values: list[float]) -> str:
        return " or ".join(f"{v * 1e3:.1f} ms (TP {g})" for v, g in zip(values, sizes))

    latency = {round(s["allreduce_latency_s"] * 1e3, 1) for s in d}
    latency_text = (
        f"{latency.pop():.1f} ms"
        if len(latency) == 1
        else each([s["allreduce_latency_s"] for s in d])
    )
    matmul = " or ".join(f"{s['matmul_s'] * 1e3:.0f} ms" for s in f)
    return (
        f"For {results['model']} on {results['roofline_device'].upper()}s, a decode step of {seqs} "
        f"sequences spends {latency_text} on all-reduce latencies and "
        f"{each([s['allreduce_bytes_s'] for s in d])} on their bytes; a {length:,}-token "
        f"prefill chunk {each([s['allreduce_latency_s'] + s['allreduce_bytes_s'] for s in f])}, "
        f"beside {matmul} of matmul FLOPs."
    )


def rate_sentence(results: dict, decode: str, prefill: str) -> str:
    """What each node size does a GPU: a decode step's tokens and a batch of prompts."""
    seqs, context = map(int, decode.split(":"))
    prompts, length = map(int, prefill.split(":"))
    parts_d, parts_f = [], []
    for n in results["nodes"]:
        g = n["size"]
        d = _step(n, "decode", seqs, context)
        f = _step(n, "prefill", prompts, length)
        tokens = round(seqs / d["seconds"] / g, -2)
        parts_d.append(
            f"a TP {g} step takes {d['seconds'] * 1e3:.1f} ms ({tokens:,.0f} tokens a second a GPU)"
        )
        each = f["seconds"] / prompts
        parts_f.append(
            f"{each * 1e3:.1f} ms a prompt at TP {g} ({1 / each / g:.0f} prompts a second a GPU)"
        )
    return (
        f"In the profile, a decode step of {seqs} sequences at {context:,} tokens of context: "
        f"{' and '.join(parts_d)}; {prompts} prompts of {length:,} tokens take "
        f"{' and '.join(parts_f)}."
    )


def latent_sentence(results: dict) -> str:
    """What the context reads and a prompt's handoff cost at each node size (MLA: the latent,
    whole on every GPU)."""
    nodes = results["nodes"]
    decode = [next(s for s in n["steps"] if s["kind"] == "decode") for n in nodes]
    prompt = next(s for s in nodes[0]["steps"] if s["kind"] == "prefill")
    reads = {f"{s['context_read_s'] * 1e3:.1f}" for s in decode}
    what = "latent" if results["mla"] else "KV"
    small, large = decode[0], decode[-1]
    return (
        f"The {what} takes {results['kv_bytes_per_token'] / 1e3:.0f} KB a token. Every GPU "
        f"reads the whole {what} of a decode step's context: "
        f"{' / '.join(sorted(reads))} ms at every size, "
        f"{small['context_read_s'] / small['seconds']:.0%} of the step of a node of "
        f"{nodes[0]['size']} GPU{'s' if nodes[0]['size'] > 1 else ''} and {large['context_read_s'] / large['seconds']:.0%} of one of "
        f"{nodes[-1]['size']}. A prefill node sends a prompt's {what} at one GPU's "
        f"{results['transfer_gbps_per_gpu']:g} GB/s ({prompt['transfer_wire_s'] * 1e3:.1f} ms for "
        f"{prompt['length']:,} tokens, plus {prompt['transfer_latency_s'] * 1e3:.1f} ms) whatever "
        "its size."
    )


def speedup_sentence(results: dict) -> str:
    """How much faster the largest node steps than the smallest, for how many more GPUs."""
    small, large = results["nodes"][0], results["nodes"][-1]
    parts = []
    for a, b in zip(small["steps"], large["steps"]):
        if a["kind"] == "decode":
            what = f"a decode step of {a['count']} sequences at {a['length']:,} tokens"
        else:
            what = _step_label(a)
        parts.append(f"{what} {a['seconds'] / b['seconds']:.1f} times")
    return (
        f"Nodes of {large['size']} GPUs against nodes of {small['size']} make "
        f"{', '.join(parts)} faster, for {large['size'] // small['size']} times the GPUs."
    )


def size_sentence(results: dict) -> str:
    """The model's parameters and weights, in the profile's dtype."""
    return (
        f"{results['model']}: {results['parameters'] / 1e9:.3g} B parameters, "
        f"{results['weight_bytes'] / 1e9:.0f} GB of weights."
    )
