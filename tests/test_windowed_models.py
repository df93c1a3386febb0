"""Models whose layers read a sliding window, served from transformers' own tiny checkpoints:
greedy outputs equal transformers' token for token in float32 with prompts several windows
long, at block sizes that do and do not divide the window, with chunked prefill splitting a
window, after preemption and with a prefix-cache hit; a windowed group's blocks stay bounded
while a sequence grows."""

from __future__ import annotations

import pytest
from checkpoints import WINDOWED_FAMILIES, hf_greedy
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.kv_manager import FREED

NEW_TOKENS = 40
WINDOW = 12  # both families' sliding_window
# Several windows long; 150 takes the CPU attention's SDPA prefill path.
PROMPT_LENGTHS = [3, 13, 30, 57, 150]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    cache = {}

    def get(family: str):
        if family not in cache:
            model_dir = checkpoint_dir(family)
            prompts = random_prompts(5, PROMPT_LENGTHS)
            cache[family] = (model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS))
        return cache[family]

    return get


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
@pytest.mark.parametrize("block_size", [4, 5])
def test_greedy_matches_transformers_at_block_sizes_that_do_and_do_not_divide_the_window(
    reference, family, block_size
):
    model_dir, prompts, expected = reference(family)
    llm = LLM(str(model_dir), block_size=block_size, num_kv_blocks=600, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_chunked_prefill_splitting_windows_matches_transformers(reference, family):
    model_dir, prompts, expected = reference(family)
    # 17 tokens a step: chunks end inside windows and blocks.
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, max_num_batched_tokens=17)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_preempted_sequences_resume_with_transformers_tokens(reference):
    model_dir, prompts, expected = reference("qwen2_sliding")
    # A pool too small for every sequence at once: the newest are preempted and recomputed.
    llm = LLM(
        str(model_dir), block_size=4, num_kv_blocks=80, max_num_batched_tokens=32, device="cpu"
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_a_prefix_hit_gives_the_same_tokens(reference, family):
    model_dir, prompts, expected = reference(family)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    assert llm.engine.block_manager.prefix_hits > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_windowed_groups_blocks_stay_bounded_while_a_sequence_grows(reference):
    model_dir, prompts, _ = reference("qwen2_sliding")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    engine = llm.engine
    engine.add_request("long", prompts[-1], SamplingParams(max_tokens=60, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        seq = engine.seqs.get("long")
        if seq is not None and seq.num_computed_tokens:
            full, *windowed = seq.block_tables
            assert FREED not in full
            held.append(max(sum(b != FREED for b in table) for table in windowed))
    # The window's 12 tokens span at most 4 blocks of 4, plus the one being written.
    assert max(held[1:]) <= 5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.cluster  # starts the second rank's process
@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_tensor_parallel_ranks_give_transformers_tokens(reference, family):
    model_dir, prompts, expected = reference(family)
    with LLM(
        str(model_dir), block_size=4, num_kv_blocks=600, device="cpu", tensor_parallel_size=2
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
