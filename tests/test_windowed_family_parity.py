"""Every family whose layers attend over windows or chunks (tests/windowed_families.py: gpt-oss,
Llama 4, Gemma 3, windowed Qwen2 and Mistral) against transformers, greedy, in float32, with
prompts several windows long: tokens equal at block sizes that do and do not divide the window,
with chunked prefill splitting windows, with a prefix-cache hit, after preemption and on two
tensor-parallel ranks; without any one of a family's features they differ, so the parity tests
each. What is one family's own (its config, its refusals) is in its file."""

from __future__ import annotations

from pathlib import Path

import pytest
from windowed_families import WINDOWED_FAMILIES, WindowedFamily

from pdserve.engine import LLM

FAMILIES = [pytest.param(family, id=name) for name, family in WINDOWED_FAMILIES.items()]
PREEMPTED = [param for param in FAMILIES if param.values[0].preemption is not None]
FEATURES = [
    pytest.param(family, remove, id=f"{name}-{remove.__name__}")
    for name, family in WINDOWED_FAMILIES.items()
    for remove in family.features
]


def generate(
    family: WindowedFamily, model_dir: Path, prompts: list[list[int]], **options: object
) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", **options)
    return [o.token_ids for o in llm.generate(prompts, family.greedy)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [4, 5])
def test_greedy_matches_transformers_at_block_sizes_that_do_and_do_not_divide_the_window(
    windowed_reference, family, block_size
):
    model_dir, prompts, expected = windowed_reference(family.name)
    options = dict(block_size=block_size, num_kv_blocks=600)
    assert generate(family, model_dir, prompts, **options) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_splitting_windows_matches_transformers(windowed_reference, family):
    model_dir, prompts, expected = windowed_reference(family.name)
    options = dict(block_size=4, num_kv_blocks=600, max_num_batched_tokens=family.prefill_chunk)
    assert generate(family, model_dir, prompts, **options) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_hit_gives_the_same_tokens(windowed_reference, family):
    model_dir, prompts, expected = windowed_reference(family.name)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    first = llm.generate(prompts, family.greedy)
    again = llm.generate(prompts, family.greedy)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("family", PREEMPTED)
def test_preempted_sequences_resume_with_transformers_tokens(windowed_reference, family):
    model_dir, prompts, expected = windowed_reference(family.name)
    blocks, chunk = family.preemption
    llm = LLM(
        str(model_dir),
        block_size=4,
        num_kv_blocks=blocks,
        max_num_batched_tokens=chunk,
        device="cpu",
    )
    outs = llm.generate(prompts, family.greedy)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


@pytest.mark.cluster  # starts the second rank's process
@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks_match_transformers(windowed_reference, family):
    model_dir, prompts, expected = windowed_reference(family.name)
    options = dict(block_size=4, num_kv_blocks=600, device="cpu", tensor_parallel_size=2)
    with LLM(str(model_dir), **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts, family.greedy)] == expected


@pytest.mark.parametrize(("family", "remove"), FEATURES)
def test_without_one_of_its_features_every_prompt_diverges(windowed_reference, family, remove):
    """What makes the parity above a test of each feature: the checkpoint's tokens depend on it."""
    model_dir, prompts, expected = windowed_reference(family.name)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    for layer in llm.engine.model.layers:
        remove(layer)
    outs = [o.token_ids for o in llm.generate(prompts, family.greedy)]
    assert all(got != want for got, want in zip(outs, expected))
