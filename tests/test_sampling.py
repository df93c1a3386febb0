"""Sampling: seeded reproducibility, top-k/top-p/min-p semantics, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import filter_probs


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256)


PROMPT = "Once upon a time"


def test_same_seed_gives_same_output(llm):
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    a, b = llm.generate([PROMPT, PROMPT], [p, p])
    assert a.token_ids == b.token_ids


def test_seeded_output_does_not_depend_on_batch_companions(llm):
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], p)
    batched = llm.generate(["noise one", PROMPT, "more noise here"], [p, p, p])
    assert batched[1].token_ids == alone.token_ids


def test_different_seeds_differ(llm):
    outs = llm.generate(
        [PROMPT] * 4,
        [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)],
    )
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    top1 = llm.generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=5, ignore_eos=True)
    )
    assert top1[0].token_ids == greedy[0].token_ids


def _probs() -> torch.Tensor:
    return torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1]])


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    out = filter_probs(_probs(), torch.tensor([0]), torch.tensor([0.75]), torch.tensor([0.0]))
    # Sorted: 0.4, 0.3 (0.7 < 0.75), 0.15 (reaches 0.85) -> tokens 1, 2, 3 kept.
    assert torch.nonzero(out[0]).flatten().tolist() == [1, 2, 3]
    assert torch.allclose(out[0, [1, 2, 3]], torch.tensor([0.4, 0.3, 0.15]) / 0.85)


def test_min_p_drops_tokens_below_fraction_of_the_top():
    out = filter_probs(_probs(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.3]))
    # Threshold 0.3 * 0.4 = 0.12: keeps 0.4, 0.3, 0.15.
    assert torch.nonzero(out[0]).flatten().tolist() == [1, 2, 3]


def test_top_k_keeps_k_most_likely():
    out = filter_probs(_probs(), torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.nonzero(out[0]).flatten().tolist() == [1, 2]
    assert torch.isclose(out.sum(), torch.tensor(1.0))


def test_sampled_tokens_follow_the_filtered_distribution(llm):
    # With top_p=0.75 only tokens 1, 2, 3 may ever be drawn, in proportion 0.4 : 0.3 : 0.15.
    probs = filter_probs(_probs(), torch.tensor([0]), torch.tensor([0.75]), torch.tensor([0.0]))
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [(probs[0] / torch.empty(5).exponential_(generator=gen)).argmax() for _ in range(4000)]
    )
    counts = torch.bincount(draws, minlength=5).float() / 4000
    assert counts[0] == 0 and counts[4] == 0
    assert torch.allclose(counts[1:4], torch.tensor([0.4, 0.3, 0.15]) / 0.85, atol=0.03)


def test_stop_token_ids_and_max_tokens_finish_sequences(llm):
    (greedy,) = llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    stop_at = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_at)
    (out,) = llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at])
    )
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12


def test_logprobs_are_log_probabilities_of_the_chosen_tokens(llm):
    (out,) = llm.generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    )
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp["token"][0] == token
        top_ids = [t for t, _ in lp["top"]]
        assert top_ids[0] == token  # greedy picks the most likely
        assert lp["token"][1] <= 0 and len(top_ids) == 3


def test_repetition_penalty_changes_greedy_output(llm):
    base = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    pen = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=2.0)
    a, b = llm.generate([PROMPT, PROMPT], [base, pen])
    assert a.token_ids != b.token_ids
    assert len(set(b.token_ids)) >= len(set(a.token_ids))


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.5), ("top_p", 0.0), ("top_k", -3), ("min_p", 1.5), ("max_tokens", 0)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_seeded_request_resumed_elsewhere_continues_its_random_stream(llm):
    # The retry path: prompt + the k tokens already streamed, sampled on from output k.
    full = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    (whole,) = llm.generate([PROMPT], full)
    k = 6
    resumed_prompt = whole.prompt_token_ids + whole.token_ids[:k]
    rest = SamplingParams(max_tokens=20 - k, temperature=1.0, seed=7, ignore_eos=True)
    engine = llm.engine
    resumed = engine.add_request("resumed", resumed_prompt, rest, output_offset=k)
    restarted = engine.add_request("restarted", resumed_prompt, rest)  # from output 0 again
    while engine.has_unfinished():
        engine.step()
    assert resumed.output_token_ids == whole.token_ids[k:]
    assert restarted.output_token_ids != whole.token_ids[k:]
