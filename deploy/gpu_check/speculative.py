"""Step `speculative`: n-gram speculative decoding against plain decoding on the GPU, greedy, in
bfloat16 and float32, on the embedded stories model: how many of plain decoding's tokens the
speculating engine reproduces (the aim: all of bf16's), and the two engines' decode rates.
Verification steps replay CUDA graphs as decode rows (`pdserve.engine.execution.decode_rows`):
the step records how many did."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pdserve.deploy.gpu_check.record import StepRecord, step_args

MODEL = "pdserve-stories"
NUM_SPECULATIVE_TOKENS = 4
SPECULATIVE_CONFIG = json.dumps(
    {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "adaptive": False}
)
# Story text repeats itself: prompt lookup finds drafts in it.
STORY = (
    "Once upon a time, there was a little cat named Tom. Tom liked to play in the garden. "
    "One day, Tom saw a big red ball in the garden. "
)
PROMPTS = [STORY, STORY[:60], STORY[40:], "Lily had a red ball.", STORY * 2, "Tom and Lily"]
NEW_TOKENS = 64


def identical_tokens(expected: list[list[int]], got: list[list[int]]) -> tuple[int, int]:
    """(tokens of `expected` that `got` reproduces, tokens of `expected`): each output counts up
    to its first difference (greedy decoding after a different token is another text)."""
    same = 0
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want, have):
            if a != b:
                break
            same += 1
    return same, sum(map(len, expected))


def _generate(llm, new_tokens: int) -> tuple[list[list[int]], float]:  # noqa: ANN001
    """Greedy outputs of PROMPTS and the seconds they took (after a short warm-up)."""
    from pdserve.engine import SamplingParams

    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outs], time.perf_counter() - start


def measure(device: str, dtype: str, new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """Plain and speculative greedy decoding of PROMPTS in `dtype`: tokens compared, decode
    rates, drafts accepted, verification steps run as decode rows and graph replays."""
    from pdserve.engine import LLM

    options = dict(device=device, dtype=dtype, num_kv_blocks=256, block_size=16)
    if device == "cuda":
        options["cuda_graph_max_batch_size"] = 8  # the batch of PROMPTS, few captures
    plain, plain_s = _generate(LLM(MODEL, **options), new_tokens)
    llm = LLM(MODEL, speculative_config=SPECULATIVE_CONFIG, **options)
    speculative, speculative_s = _generate(llm, new_tokens)
    same, total = identical_tokens(plain, speculative)
    graphs = llm.engine.runner.decode_graphs
    stats = llm.engine.stats
    return {
        "dtype": dtype,
        "identical_tokens": same,
        "tokens": total,
        "plain_tok_s": total / plain_s,
        "speculative_tok_s": sum(map(len, speculative)) / speculative_s,
        "speedup": plain_s / speculative_s,
        "draft_tokens": stats.num_draft_tokens,
        "accepted_tokens": stats.num_accepted_tokens,
        "row_steps": graphs.row_steps if graphs is not None else 0,
        "graph_replays": graphs.replays if graphs is not None else 0,
    }


def main(argv: list[str] | None = None) -> int:
    args = step_args(__doc__.split("\n\n")[0], argv)
    record = StepRecord(args.json)
    import torch

    if not torch.cuda.is_available():
        record.finish("no CUDA device", status="skipped")
        return 0
    # The aim reads the bf16 case at the top level; float32 goes under "float32".
    bf16 = measure("cuda", "bfloat16")
    record.data.update(bf16)
    record.save()
    if bf16["row_steps"] == 0:
        record.fail("speculative/bfloat16", "no verification step replayed a graph")
    if args.deadline.left() > 15:
        f32 = record.data["float32"] = measure("cuda", "float32")
        if f32["identical_tokens"] != f32["tokens"]:
            record.fail("speculative/float32", "greedy tokens differ from plain decoding's")
    else:
        record.note("float32 not run: the time box ended")
    record.figures = {
        "identical_tokens": bf16["identical_tokens"],
        "tokens": bf16["tokens"],
        "speedup": round(bf16["speedup"], 3),
    }
    record.finish(
        f"bf16: {bf16['identical_tokens']}/{bf16['tokens']} greedy tokens identical to plain "
        f"decoding; {bf16['speedup']:.2f}x plain decoding's rate, "
        f"{bf16['accepted_tokens']}/{bf16['draft_tokens']} drafts accepted, "
        f"{bf16['row_steps']} verification steps as graph rows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
