"""One round of vLLM's offline engine on a request file, run by `.venv-vllm/bin/python` (made by
`make bench-peers`): loads the checkpoint with vLLM's defaults (its CPU backend: torch.compile,
its own OpenMP thread binding) apart from max_num_seqs and a fixed KV pool, warms up on two short requests, then
times `LLM.generate` over every request (greedy, the same token ids, max_tokens = the request's
output length, ignore_eos) and prints one result line (protocol.RESULT_PREFIX + JSON).

    .venv-vllm/bin/python bench/peers/vllm_runner.py --model DIR --requests FILE

vLLM starts its engine in another process, so the LLM is made under `__main__` only."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__:
    from pdserve.bench.peers.protocol import (
        RoundResult,
        machine_cpu_seconds,
        parse_runner_args,
        read_requests,
        result_line,
    )
else:  # run as a script from vLLM's virtualenv, where pdserve is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from protocol import (
        RoundResult,
        machine_cpu_seconds,
        parse_runner_args,
        read_requests,
        result_line,
    )

KV_CACHE_BYTES = 1 << 30


def engine_options(args) -> dict:
    """vLLM's LLM(...) keyword arguments: its defaults except what both engines must share."""
    return {
        "model": str(args.model),
        "dtype": "float32",
        "skip_tokenizer_init": True,  # prompts are token ids; nothing is detokenized
        "max_num_seqs": args.max_num_seqs,
        # A fixed KV pool (vLLM's CPU default reserves 92% of the host's memory); 1 GiB holds
        # every request of the benchmark's workloads at once, as pdserve's pool does.
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "seed": 0,
    }


def cpu_seconds() -> float:
    """CPU time of this process and its children (vLLM's engine core runs in a child)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def main(argv: list[str] | None = None) -> None:
    args = parse_runner_args(argv, description=__doc__)
    requests = read_requests(args.requests)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_options(args))

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    warm = [TokensPrompt(prompt_token_ids=p) for p in ([5, 6, 7], [8, 9])]
    llm.generate(warm, [params(4), params(4)], use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r.prompt) for r in requests]
    sampling = [params(r.output_len) for r in requests]
    busy, cpu, start = machine_cpu_seconds(), cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    busy = machine_cpu_seconds() - busy
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r.output_len for r in requests)
    if produced != expected:
        raise SystemExit(f"vllm produced {produced} tokens, expected {expected}")
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)  # 0: vLLM's own binding
    result = RoundResult("vllm", elapsed, produced, cpu, vllm.__version__, threads, busy)
    print(result_line(result), flush=True)


if __name__ == "__main__":
    main()
