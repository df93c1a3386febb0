"""What an FP8 KV cache (`--kv-cache-dtype fp8`) costs in accuracy and saves in bytes, side by
side in one run against the same model with its KV cache in the model's dtype (float32 on CPU):
over the same greedy requests, the share of output tokens equal position by position, of first
tokens equal, of whole outputs equal; the mean gap between the two caches' log-probabilities of
the reference's token while both runs share their context (up to and including the first token
where they part); and the bytes one token's KV takes (what a handoff moves per token) in FP8,
bfloat16 and float32.

    python -m pdserve.bench.kv_fp8
    python -m pdserve.bench.kv_fp8 --model llama-50m --prompts 200 \
        --json-out bench/results/kv_fp8_llama-50m.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from pdserve.bench.peers import models as bench_models
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.embedded.catalog import EMBEDDED
from pdserve.engine.kv.cache import KVLayout
from pdserve.tune import provenance

PROG = "pdserve.bench.kv_fp8"
TOP = 5  # log-probabilities of the top tokens each run reports, to find the other run's token


def model_path(model: str) -> str:
    """An embedded model's name as it is, a bench model built if needed, or a directory."""
    return model if model in EMBEDDED else str(bench_models.resolve(model))


def prompts_for(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def logprob_gaps(
    ref: list[dict], fp8: list[dict], ref_tokens: list[int], fp8_tokens: list[int]
) -> list[float]:
    """|log p_fp8 - log p_ref| of the reference's token at each position where both runs had
    the same context, where the FP8 run's top tokens include it."""
    gaps = []
    for i, (a, b) in enumerate(zip(ref_tokens, fp8_tokens)):
        theirs = dict(fp8[i]["top"]) | dict([fp8[i]["token"]])
        if a in theirs:
            gaps.append(abs(theirs[a] - ref[i]["token"][1]))
        if a != b:
            break
    return gaps


def bytes_per_token(layout: KVLayout) -> dict:
    """One token's KV bytes over every layer, and per layer, in this layout's dtype and in the
    others."""
    out = {}
    for name, dtype in (("fp8", "fp8_e4m3"), ("bfloat16", "bfloat16"), ("float32", "float32")):
        lay = KVLayout.from_dict({**layout.to_dict(), "dtype": dtype})
        per_token = lay.bytes_per_block // lay.block_size
        out[name] = {"all_layers": per_token, "per_layer": per_token // lay.num_slots}
    return out


def measure(args: argparse.Namespace) -> dict:
    model = model_path(args.model)
    options = dict(device="cpu", num_kv_blocks=4096, block_size=16, max_num_seqs=64)
    ref = LLM(model, **options)
    fp8 = LLM(model, kv_cache_dtype="fp8", **options)
    prompts = prompts_for(ref.engine.vocab_size, args.prompts, *args.prompt_len, args.seed)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0, ignore_eos=True, logprobs=TOP
    )
    want = ref.generate(prompts, params)
    got = fp8.generate(prompts, params)
    positions = sum(len(w.token_ids) for w in want)
    equal = sum(a == b for w, g in zip(want, got) for a, b in zip(w.token_ids, g.token_ids))
    gaps = [
        gap
        for w, g in zip(want, got)
        for gap in logprob_gaps(w.logprobs, g.logprobs, w.token_ids, g.token_ids)
    ]
    sizes = bytes_per_token(fp8.engine.layout)
    return {
        "model": args.model,
        "reference_kv_dtype": ref.engine.layout.dtype,
        "prompts": len(prompts),
        "prompt_len": list(args.prompt_len),
        "max_tokens": args.max_tokens,
        "tokens_equal_share": round(equal / positions, 4),
        "first_tokens_equal_share": round(
            sum(w.token_ids[0] == g.token_ids[0] for w, g in zip(want, got)) / len(prompts), 4
        ),
        "outputs_equal_share": round(
            sum(w.token_ids == g.token_ids for w, g in zip(want, got)) / len(prompts), 4
        ),
        "mean_logprob_gap": round(statistics.fmean(gaps), 5) if gaps else None,
        "logprob_positions": len(gaps),
        "kv_bytes_per_token": sizes,
        "fp8_over_bf16_bytes": round(
            sizes["fp8"]["all_layers"] / sizes["bfloat16"]["all_layers"], 4
        ),
    }


# --- the docs' table (`python -m pdserve.bench.docs` renders it from the results files) -------


def docs_table(*results: dict) -> str:
    """Each run's agreement of the FP8 cache with the float one, and its bytes per token."""
    out = [
        "| model | prompts × tokens | first tokens equal | tokens equal | outputs equal "
        "| mean log-prob gap | FP8 bytes / token | bf16 bytes / token | FP8 / bf16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for res in results:
        sizes = res["kv_bytes_per_token"]
        out.append(
            f"| {res['model']} | {res['prompts']} × {res['max_tokens']} "
            f"| {res['first_tokens_equal_share']:.0%} | {res['tokens_equal_share']:.0%} "
            f"| {res['outputs_equal_share']:.0%} | {res['mean_logprob_gap']:.3f} "
            f"| {sizes['fp8']['all_layers']:,} | {sizes['bfloat16']['all_layers']:,} "
            f"| {res['fp8_over_bf16_bytes']:.4f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="pdserve-stories", help="an embedded or bench model, or a directory"
    )
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("LO", "HI"))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    record = provenance.start(sys.argv if argv is None else ["python", "-m", PROG, *argv])
    measured = measure(args)
    results = provenance.finish(record) | measured
    print(json.dumps(measured, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
