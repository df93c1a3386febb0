"""Step `parity`: float32 on the GPU, the Triton path against the torch reference path and against
`transformers`, on the checkpoints the CPU parity tests use (tests/checkpoints.py, the prompts
and lengths of tests/test_parity.py): greedy tokens must be equal, and the step reports how far
apart the two paths' top-5 logprobs are."""

from __future__ import annotations

import sys
from pathlib import Path

from pdserve.deploy.gpu_check import deps
from pdserve.deploy.gpu_check.record import StepRecord, step_args

# (family, block size): every family at the default block, Llama at 1 and 32 too (Triton takes
# powers of two only; the CPU test's 7 is the reference path's). The mixtures of experts run the
# fused Triton MoE, in the decode graphs too; DeepSeek's the latent attention kernels.
CASES = [("llama", 16), ("qwen2", 16), ("qwen3", 16), ("llama", 1), ("llama", 32)]
CASES += [("mixtral", 16), ("qwen2_moe", 16), ("qwen3_moe", 16)]
CASES += [("deepseek_v2", 16), ("deepseek_v3", 16)]
TOP = 5


def generate(model: Path, backend: str, block_size: int, prompts, new_tokens: int):  # noqa: ANN001, ANN201
    from pdserve.engine import LLM, SamplingParams

    # Graphs up to 8 rows cover the batch of 4 prompts with fewer captures than the default.
    options = dict(block_size=block_size, num_kv_blocks=1024 // block_size)
    options["cuda_graph_max_batch_size"] = 8
    llm = LLM(str(model), device="cuda", dtype="float32", kernel_backend=backend, **options)
    assert llm.engine.ops.name == backend
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=TOP)
    return llm.generate(prompts, params)


def logprob_gap(a, b) -> float:  # noqa: ANN001
    """Largest difference of the chosen tokens' logprobs while both paths agree on the tokens."""
    gap = 0.0
    for out_a, out_b in zip(a, b):
        for la, lb, ta, tb in zip(out_a.logprobs, out_b.logprobs, out_a.token_ids, out_b.token_ids):
            if ta != tb:
                break
            gap = max(gap, abs(la["token"][1] - lb["token"][1]))
    return gap


def main(argv: list[str] | None = None) -> int:
    args = step_args(__doc__.split("\n\n")[0], argv)
    record = StepRecord(args.json)
    import torch

    if not torch.cuda.is_available():
        record.finish("no CUDA device", status="skipped")
        return 0
    sys.path.insert(0, str(deps.REPO / "tests"))
    from checkpoints import build_checkpoint, hf_greedy
    from conftest import random_prompts
    from test_parity import NEW_TOKENS, PROMPT_LENGTHS

    prompts = random_prompts(1, PROMPT_LENGTHS)
    work = Path(args.work)
    built: dict[str, tuple[Path, list]] = {}
    rows = record.data.setdefault("cases", [])
    for family, block_size in CASES:
        if args.deadline.left() < 10:
            record.note(f"stopped at the time box before {family} block {block_size}")
            break
        if family not in built:
            model = build_checkpoint(family, work / family)
            built[family] = (model, hf_greedy(model, prompts, NEW_TOKENS))
        model, hf = built[family]
        triton = generate(model, "triton", block_size, prompts, NEW_TOKENS)
        ref = generate(model, "torch", block_size, prompts, NEW_TOKENS)
        row = {
            "family": family,
            "block_size": block_size,
            "triton_equals_torch": [o.token_ids for o in triton] == [o.token_ids for o in ref],
            "triton_equals_transformers": [o.token_ids for o in triton] == hf,
            "torch_equals_transformers": [o.token_ids for o in ref] == hf,
            "max_logprob_gap": logprob_gap(triton, ref),
        }
        rows.append(row)
        label = f"parity/{family}, block {block_size}"
        if not row["triton_equals_torch"]:
            record.fail(label, "Triton greedy tokens differ from the torch reference path's")
        if not row["triton_equals_transformers"]:
            record.fail(label, "Triton greedy tokens differ from transformers'")
        if not row["torch_equals_transformers"]:
            record.fail(label, "the torch reference path on CUDA differs from transformers")
        record.save()
    gap = max((r["max_logprob_gap"] for r in rows), default=0.0)
    record.figures = {"cases": len(rows), "max_logprob_gap": gap}
    same = sum(r["triton_equals_torch"] and r["triton_equals_transformers"] for r in rows)
    record.finish(
        f"{same}/{len(rows)} cases token-identical (Triton, torch, transformers); "
        f"largest logprob gap Triton vs torch {gap:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
