"""The compiled model step: token counts padded to buckets, greedy outputs equal to the eager
step's and to transformers' from steps that really ran compiled, and an eager run (said in a
warning) where compiling cannot work."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from checkpoints import hf_greedy

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.execution.compiled_step import bucket, compile_unavailable

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW_TOKENS = 8
# Few buckets (1, 2, 4 at start-up, 16 for the prefill): compiling each takes seconds on 2 cores.
OPTIONS = dict(device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)


def test_token_counts_pad_to_power_of_two_buckets():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket(65, 64) == 65  # past the largest bucket: as it is


def _greedy(model_dir, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), **OPTIONS, **options)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm


needs_compiler = pytest.mark.skipif(
    compile_unavailable("cpu") is not None, reason="no C++ compiler"
)


@needs_compiler
@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("fp8", marks=pytest.mark.slow)])
def test_embedded_model_step_runs_compiled_with_the_eager_tokens(caplog, kv_cache_dtype):
    # The quick tier's case of the compiled step (one small model, three decode buckets and one
    # prefill bucket compiled): a step that falls back to eager, as the CPU rotary's `out=`
    # writes into half-head views once made it at warm-up, fails here rather than pass on eager
    # tokens. fp8: the FP8 cache's writes and attention behind the opaque ops.
    options = dict(OPTIONS, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    eager = LLM(**options).generate(PROMPTS, params)
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(**options, compile=True)
        compiled = llm.generate(PROMPTS, params)
    assert llm.engine.runner.runs_compiled, caplog.text
    assert "compile: failed" not in caplog.text
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]


@needs_compiler
def test_a_step_that_fails_to_compile_at_warm_up_says_so_and_runs_eagerly(
    checkpoint_dir, caplog, monkeypatch
):
    # The CPU rotary (halves written through `out=` views) is what dynamo cannot trace: put it
    # back into the compiled step's ops and the warm-up must fail loudly, not claim a compiled
    # step.
    from pdserve.engine.execution import compiled_step
    from pdserve.kernels import rotary_cpu

    monkeypatch.setattr(compiled_step.rotary_ref, "apply_rotary", rotary_cpu.apply_rotary)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.tp.model_shard"):
        tokens, llm = _greedy(checkpoint_dir("llama"), compile=True)
    assert not llm.engine.runner.runs_compiled
    assert llm.engine.runner.compiled is None
    assert "compile: failed at warm-up (Unsupported: " in caplog.text
    assert "`out=`" in caplog.text and "runs eagerly" in caplog.text
    assert "model step compiled in" not in caplog.text
    assert tokens == hf_greedy(checkpoint_dir("llama"), PROMPTS, NEW_TOKENS)


@pytest.mark.slow
@needs_compiler
def test_compiled_windowed_model_equals_transformers(checkpoint_dir, caplog):
    # Mistral's window (12) on every layer: one KV group, so the step compiles; blocks of 4 and
    # prompts and outputs past the window, so its block tables hold given-back blocks.
    model_dir = checkpoint_dir("mistral_sliding")
    prompts = [PROMPTS[0], list(range(20, 38))]
    options = dict(device="cpu", num_kv_blocks=32, max_num_batched_tokens=16, block_size=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(str(model_dir), compile=True, **options)
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.runs_compiled, caplog.text
    assert tokens == hf_greedy(model_dir, prompts, 16)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe", "deepseek_v3"])
def test_compiled_greedy_equals_eager_and_transformers(checkpoint_dir, caplog, family):
    # qwen3: q/k norms besides Llama's parts; qwen2_moe: routed experts behind their custom op
    # and a shared expert; deepseek_v3: latent writes and attention behind theirs
    model_dir = checkpoint_dir(family)
    expected = hf_greedy(model_dir, PROMPTS, NEW_TOKENS)
    eager, _ = _greedy(model_dir)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.tp.model_shard"):
        compiled, llm = _greedy(model_dir, compile=True)
    assert llm.engine.runner.runs_compiled
    assert "model step compiled in" in caplog.text and "compile: failed" not in caplog.text
    assert eager == expected
    assert compiled == expected


ENGINES_IN_ONE_PROCESS = """
import json, sys
from pdserve.engine import LLM, SamplingParams
paths, prompts, options = sys.argv[1].split(","), json.loads(sys.argv[2]), json.loads(sys.argv[3])
params = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0, ignore_eos=True)
out = []
for path in paths:
    llm = LLM(path, compile=True, **options)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    out.append({"compiled": llm.engine.runner.runs_compiled, "tokens": tokens})
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_compiler
def test_compiled_engines_of_other_shapes_in_one_process_each_equal_transformers(checkpoint_dir):
    # In a fresh process: llama, qwen2 and qwen3 (other shapes, other pools), then llama again,
    # each compiled. Without the pool's shape marked static the second engine's graphs took the
    # pool's dimensions as symbolic and produced wrong tokens; with dynamo's recompile limit
    # shared by every engine's step (one code object, some 6 graphs a model), the third model's
    # prefill failed to compile and ran eagerly.
    families = ["llama", "qwen2", "qwen3", "llama"]
    paths = ",".join(str(checkpoint_dir(family)) for family in families)
    args = [paths, json.dumps(PROMPTS), json.dumps(OPTIONS), str(NEW_TOKENS)]
    done = subprocess.run(
        [sys.executable, "-c", ENGINES_IN_ONE_PROCESS, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    engines = json.loads(done.stdout.strip().splitlines()[-1])
    assert [e["compiled"] for e in engines] == [True] * len(families), done.stderr[-2000:]
    for family, engine in zip(families, engines):
        assert engine["tokens"] == hf_greedy(checkpoint_dir(family), PROMPTS, NEW_TOKENS), family


def test_without_a_compiler_the_step_runs_eagerly_saying_why(checkpoint_dir, caplog, monkeypatch):
    from pdserve.engine.execution import compiled_step

    monkeypatch.setattr(compiled_step.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.tp.model_shard"):
        tokens, llm = _greedy(checkpoint_dir("llama"), compile=True)
    assert llm.engine.runner.compiled is None and not llm.engine.runner.runs_compiled
    assert "no C++ compiler" in caplog.text and "runs eagerly" in caplog.text
    assert tokens == hf_greedy(checkpoint_dir("llama"), PROMPTS, NEW_TOKENS)


def test_a_shape_that_fails_to_compile_runs_eagerly_from_then_on(checkpoint_dir, caplog):
    import torch

    from pdserve.engine.execution.compiled_step import CompiledStep
    from pdserve.engine.execution.forward_batch import AttentionBatch

    llm = LLM(str(checkpoint_dir("llama")), device="cpu", num_kv_blocks=8)
    runner = llm.engine.runner
    step = CompiledStep(runner.model, runner.pool, runner.ops, 16)

    def broken(*args):
        raise RuntimeError("inductor: no\nmore")

    step._fn = broken
    ids, positions = torch.tensor([5, 6, 7]), torch.arange(3)
    batch = AttentionBatch(
        torch.arange(3),
        torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([3]),
        torch.tensor([0, 3]),
        3,
    )
    with (
        torch.inference_mode(),
        caplog.at_level(logging.WARNING, logger="pdserve.engine.execution.compiled_step"),
    ):
        got = step(ids, positions, batch)
        want = runner.model(ids, positions, batch, runner.pool, runner.ops)
    torch.testing.assert_close(got, want)
    assert "compile: failed for 3 tokens (RuntimeError: inductor: no); steps run eagerly" in (
        caplog.text
    )
    assert step.failure == "RuntimeError: inductor: no" and not step.runs_compiled
