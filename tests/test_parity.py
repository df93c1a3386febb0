"""Greedy outputs equal transformers' own generation token for token, in float32."""

from __future__ import annotations

import pytest
from checkpoints import hf_greedy
from conftest import COMPILE, random_prompts

from pdserve.engine import LLM, SamplingParams

NEW_TOKENS = 32
pytestmark = pytest.mark.usefixtures("steps_really_compiled")
# 150: long enough for the CPU attention's prefill path (SDPA), whole and in chunks.
PROMPT_LENGTHS = [3, 16, 29, 50, 150]


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    cache = {}

    def get(family: str):
        if family not in cache:
            model_dir = checkpoint_dir(family)
            prompts = random_prompts(1, PROMPT_LENGTHS)
            cache[family] = (model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS))
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_batched_greedy_matches_transformers(reference, family):
    model_dir, prompts, expected = reference(family)
    # float32, as transformers runs
    llm = LLM(str(model_dir), num_kv_blocks=64, device="cpu", compile=COMPILE)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_paged_path_is_exact_for_any_block_size(reference, block_size):
    # 7 divides none of the prompt lengths, so blocks end mid-prompt and mid-generation.
    model_dir, prompts, expected = reference("llama")
    blocks = 1024 // block_size
    llm = LLM(
        str(model_dir), block_size=block_size, num_kv_blocks=blocks, device="cpu", compile=COMPILE
    )
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected


def test_long_prompts_prefilled_in_chunks_after_their_context_match_transformers(reference):
    # 80 tokens a step: the 150-token prompt is prefilled as 80 tokens, then 70 after those 80
    # (both long enough for the CPU attention's SDPA path, the second with a shifted diagonal).
    model_dir, prompts, expected = reference("llama")
    llm = LLM(
        str(model_dir), num_kv_blocks=64, max_num_batched_tokens=80, device="cpu", compile=COMPILE
    )
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected
