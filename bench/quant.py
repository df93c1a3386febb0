"""What a quantized checkpoint costs and saves on the CPU, side by side in one run against the
same model in bfloat16: the weight bytes the loaded model holds, and the offline engine's
throughput on the same greedy requests (each writing exactly max_tokens), rounds alternating.
The quantized checkpoint is the bf16 one written by our writers of the published layouts
(`--format`): `fp8`, Hugging Face's fine-grained FP8 (`engine.quant.fp8_checkpoint`, blocks of
128x128), or compressed-tensors (`engine.quant.compressed_tensors_checkpoint`) `ct-w4a16` (4-bit,
groups of 128), `ct-fp8` (FP8 per channel) or `ct-int8` (INT8 per channel), `awq` (AutoAWQ's
4-bit GEMM layout in groups of 128) or `gptq` (AutoGPTQ's 4-bit layout in groups of 128,
symmetric, act-order; `engine.quant.packed_checkpoint`); activations are bfloat16 for both.

    python -m pdserve.bench.quant
    python -m pdserve.bench.quant --model llama-50m --requests 8 --max-tokens 32 \
        --json-out bench/results/quant_fp8_cpu.json
    python -m pdserve.bench.quant --format ct-w4a16 --json-out bench/results/quant_ct-w4a16_llama9m.json
    python -m pdserve.bench.quant --format gptq --json-out bench/results/quant_gptq_llama9m.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.peers import models as bench_models
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.quant.compressed_tensors_checkpoint import (
    PRESETS,
    write_compressed_tensors_checkpoint,
)
from pdserve.engine.quant.fp8_checkpoint import write_fp8_checkpoint
from pdserve.engine.quant.packed_checkpoint import write_awq_checkpoint, write_gptq_checkpoint
from pdserve.tune import provenance

PROG = "pdserve.bench.quant"
BLOCK = (128, 128)
# --format -> the compressed-tensors preset written (llm-compressor's names).
CT_FORMATS = {"ct-w4a16": "W4A16", "ct-fp8": "FP8_DYNAMIC", "ct-int8": "W8A8"}
GROUP = 128  # awq and gptq
FORMATS = ("fp8", *CT_FORMATS, "awq", "gptq")
LABELS = {
    "fp8": "FP8",
    "ct-w4a16": "W4A16",
    "ct-fp8": "CT FP8",
    "ct-int8": "INT8",
    "awq": "AWQ",
    "gptq": "GPTQ",
}


def write_quantized(plain: Path, out_dir: Path, fmt: str) -> Path:
    """The bf16 checkpoint `plain` written in format `fmt` (one of FORMATS)."""
    if fmt == "fp8":
        return write_fp8_checkpoint(plain, out_dir, BLOCK)
    if fmt == "awq":
        return write_awq_checkpoint(plain, out_dir, GROUP)
    if fmt == "gptq":
        return write_gptq_checkpoint(plain, out_dir, GROUP, desc_act=True)
    return write_compressed_tensors_checkpoint(plain, out_dir, PRESETS[CT_FORMATS[fmt]])


def weight_bytes(llm: LLM) -> int:
    """The bytes of the loaded model's parameters (a tied head counted once)."""
    seen: set[int] = set()
    total = 0
    for p in llm.engine.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / (time.perf_counter() - start), tokens


def measure(args: argparse.Namespace, work: Path) -> dict:
    plain = bench_models.resolve(args.model)
    fmt = args.format
    quantized = write_quantized(plain, work / fmt, fmt)
    engines = {
        "bf16": LLM(str(plain), dtype="bfloat16", num_kv_blocks=1024, block_size=16),
        fmt: LLM(str(quantized), dtype="bfloat16", num_kv_blocks=1024, block_size=16),
    }
    prompts = [
        [(7 * i + j) % 1000 + 2 for j in range(args.prompt_len)] for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outputs = {}
    for name, llm in engines.items():  # warm-up, and the outputs compared
        outputs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    rounds = []
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        row = {}
        for name in order:
            rate, tokens = throughput(engines[name], prompts, params)
            row[name] = {"tokens_per_s": round(rate, 1), "tokens": tokens}
        rounds.append(row)
        print(
            f"round {r + 1}: " + ", ".join(f"{n} {row[n]['tokens_per_s']} tok/s" for n in engines)
        )
    same = sum(a == b for a, b in zip(outputs["bf16"], outputs[fmt]))
    return {
        "model": args.model,
        "format": fmt,
        "weight_bytes": {name: weight_bytes(llm) for name, llm in engines.items()},
        "rounds": rounds,
        f"{fmt}_over_bf16": round(
            statistics.median(r[fmt]["tokens_per_s"] / r["bf16"]["tokens_per_s"] for r in rounds),
            3,
        ),
        "same_greedy_outputs": f"{same} of {len(prompts)}",
    }


def docs_table(*results: dict) -> str:
    """Weight bytes and throughput, bf16 against the quantized copy, a row per model (bench.docs
    renders it); the results are of one format (a results file without `format` is FP8's)."""
    fmt = results[0].get("format", "fp8")
    label = LABELS[fmt]
    lines = [
        f"| model | weights bf16 | weights {label} | {label} / bf16 bytes | tok/s bf16, per round | "
        f"tok/s {label}, per round | {label} / bf16 tok/s (median) | same greedy outputs |",
        "| --- | ---: | ---: | ---: | --- | --- | ---: | --- |",
    ]
    for res in results:
        if res.get("format", "fp8") != fmt:
            raise ValueError(f"results of {res['format']} in a table of {fmt}")
        w = res["weight_bytes"]
        per = {n: " / ".join(f"{r[n]['tokens_per_s']:,.0f}" for r in res["rounds"]) for n in w}
        lines.append(
            f"| {res['model']} | {w['bf16'] / 2**20:.1f} MiB | {w[fmt] / 2**20:.1f} MiB | "
            f"{w[fmt] / w['bf16']:.2f} | {per['bf16']} | {per[fmt]} | "
            f"{res[f'{fmt}_over_bf16']:.2f} | {res['same_greedy_outputs']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-9m", help="a bench model (bench.peers.models)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--format", choices=FORMATS, default="fp8", help="the quantized layout")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    record = provenance.start(sys.argv if argv is None else ["python", "-m", PROG, *argv])
    with tempfile.TemporaryDirectory(prefix="pdserve-quant-") as tmp:
        results = measure(args, Path(tmp))
    results = provenance.finish(record) | results
    print(docs_table(results))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
