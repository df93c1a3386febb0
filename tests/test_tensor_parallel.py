"""Tensor parallelism on CPU for real: worker ranks in their own processes, gloo collectives.
TP=2 and TP=4 generate transformers' (and TP=1's) greedy tokens for Llama with GQA, Qwen2 (bias,
tied embeddings) and Qwen3 (q/k norm), with fewer KV heads than ranks at TP=4; logits stay within
1e-4 of TP=1's; preemption, chunked prefill and prefix-cache hits change nothing; a rank that
dies takes its group down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoints import hf_greedy
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp.ranks import TPGroupFailed

pytestmark = pytest.mark.cluster

NEW_TOKENS = 24
PROMPT_LENGTHS = [3, 16, 29, 50]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
REPO = Path(__file__).resolve().parent.parent


def recording_logits(llm: LLM) -> list[torch.Tensor]:
    """Every step's logits on rank 0, from now on."""
    executor = llm.engine.executor
    forward = executor.forward
    steps: list[torch.Tensor] = []

    def recorded(out):  # noqa: ANN001, ANN202
        logits, rows = forward(out)
        steps.append(logits.clone())
        return logits, rows

    executor.forward = recorded
    return steps


@pytest.fixture(scope="module")
def family_run(checkpoint_dir):
    """family -> (model dir, prompts, transformers' tokens, TP=1's tokens and step logits)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model_dir = checkpoint_dir(family)
            prompts = random_prompts(1, PROMPT_LENGTHS)
            llm = LLM(str(model_dir), num_kv_blocks=64, device="cpu")
            logits = recording_logits(llm)
            tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
            cache[family] = (model_dir, prompts, expected, tokens, logits)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def llama_tp4(checkpoint_dir):
    """Kept for the last test of the module, which kills one of its ranks."""
    with LLM(
        str(checkpoint_dir("llama")), num_kv_blocks=64, device="cpu", tensor_parallel_size=4
    ) as llm:
        yield llm


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tensor_parallel_greedy_tokens_equal_tp1_and_transformers(
    family_run, family, size, request
):
    # llama: 8 query heads on 2 KV heads, so at TP=4 each KV head lives on two ranks.
    model_dir, prompts, expected, tp1_tokens, tp1_logits = family_run(family)
    assert tp1_tokens == expected
    if (family, size) == ("llama", 4):
        llm = request.getfixturevalue("llama_tp4")
        logits = recording_logits(llm)
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    else:
        with LLM(str(model_dir), num_kv_blocks=64, device="cpu", tensor_parallel_size=size) as llm:
            logits = recording_logits(llm)
            tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert tokens == expected
    assert len(logits) == len(tp1_logits)
    for ours, theirs in zip(logits, tp1_logits):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() < 1e-4


# --- scheduling under TP=2: the same decisions on rank 0, the same pages on every rank ---------

TIGHT = dict(num_kv_blocks=20, block_size=8, max_num_batched_tokens=32, device="cpu")


@pytest.fixture(scope="module")
def tight_pair(checkpoint_dir):
    """TP=1 and TP=2 engines with few blocks (preemption) and a small step budget (chunking)."""
    model_dir = str(checkpoint_dir("llama"))
    with LLM(model_dir, **TIGHT, tensor_parallel_size=2) as tp2:
        yield LLM(model_dir, **TIGHT), tp2


def test_preempted_sequences_resume_with_the_tokens_of_tp1(tight_pair):
    tp1, tp2 = tight_pair
    prompts = random_prompts(2, [20, 25, 30, 22])
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    before = tp2.engine.scheduler.num_preemptions
    outs = [[o.token_ids for o in llm.generate(prompts, params)] for llm in (tp1, tp2)]
    assert tp2.engine.scheduler.num_preemptions > before
    assert outs[0] == outs[1]


def test_a_chunked_prefill_gives_the_tokens_of_tp1(tight_pair):
    tp1, tp2 = tight_pair
    prompts = random_prompts(3, [100])  # four chunks of 32 tokens at most
    steps = tp2.engine.stats.num_steps
    outs = [[o.token_ids for o in llm.generate(prompts, GREEDY)] for llm in (tp1, tp2)]
    assert tp2.engine.stats.num_steps - steps >= 4 + NEW_TOKENS - 1
    assert outs[0] == outs[1]


def test_prefix_cache_hits_give_the_tokens_of_tp1(tight_pair):
    tp1, tp2 = tight_pair
    shared = random_prompts(4, [40])[0]
    prompts = [shared + [5 + i] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    hits = tp2.engine.block_manager.prefix_hits
    outs = [
        [[o.token_ids for o in llm.generate([p], params)] for p in prompts] for llm in (tp1, tp2)
    ]
    assert tp2.engine.block_manager.prefix_hits - hits >= 2 * 5  # 5 full blocks, twice
    assert outs[0] == outs[1]


# --- failure: one rank dies, the group goes down ---------------------------------------------------


def wait_for_exit(pids: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in pids):
            return
        time.sleep(0.05)
    raise AssertionError(f"processes {pids} still running after {timeout_s}s")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return False


RANK0 = """
import sys
from pdserve.engine import LLM
llm = LLM(sys.argv[1], num_kv_blocks=32, device="cpu", tensor_parallel_size=2)
print(*llm.engine.ranks.pids, flush=True)
sys.stdin.read()
"""


def test_the_other_ranks_exit_when_rank_0_is_killed(checkpoint_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK0, str(checkpoint_dir("qwen3"))],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 1
    proc.kill()
    proc.wait(10)
    wait_for_exit(pids)


def test_pdserve_generate_runs_tensor_parallel():
    args = [
        "generate",
        "--prompt",
        "Hello",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--device",
        "cpu",
        "--num-kv-blocks",
        "32",
        "--tensor-parallel-size",
        "2",
    ]
    res = subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (expected,) = LLM(num_kv_blocks=32, device="cpu").generate(["Hello"], params)
    assert res.stdout == expected.text + "\n"


def test_a_rank_killed_mid_generation_takes_its_group_down(llama_tp4):
    engine = llama_tp4.engine
    ranks = engine.ranks
    told: list[tuple[float, str]] = []
    engine.watch_failure(lambda why: told.append((time.monotonic(), why)))
    engine.add_request("r", random_prompts(5, [12])[0], SamplingParams(max_tokens=200))
    engine.step()
    engine.step()
    killed = time.monotonic()
    os.kill(ranks.pids[1], signal.SIGKILL)  # rank 2
    # The watcher is told at once, with no step of rank 0's to find it.
    while not told and time.monotonic() - killed < 10:
        time.sleep(0.005)
    assert told and "rank 2 (exit code -9)" in told[0][1]
    assert told[0][0] - killed < 0.5, f"told {told[0][0] - killed:.2f} s after the kill"
    with pytest.raises(TPGroupFailed, match="rank 2 \\(exit code -9\\)"):
        while engine.has_unfinished():
            engine.step()
    wait_for_exit(ranks.pids)  # ranks 1 and 3 are gone too
    with pytest.raises(TPGroupFailed):
        engine.step()
