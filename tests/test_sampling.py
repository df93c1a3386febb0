"""Sampling: seeded reproducibility wherever a request is sampled, the counter-based noise and the
distribution it draws from, top-k/top-p/min-p semantics, penalties, logprobs."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sampler import apply_penalties, filter_probs, sample, seeded_noise
from pdserve.engine.sequence import Sequence


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


# --- the counter-based sampler, without a model --------------------------------------------------

DRAWS = 20_000
_request_ids = itertools.count()


def _seq(
    params: SamplingParams, output_offset: int = 0, token_ids: tuple[int, ...] = (0,)
) -> Sequence:
    return Sequence(f"r-{next(_request_ids)}", list(token_ids), params, output_offset=output_offset)


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def _within_sampling_error(freq: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    """Every frequency within 5 standard errors of its probability. The draws come from fixed
    seeds, so the outcome is deterministic: a sampler from the wrong distribution fails it."""
    probs = probs.double()
    return bool(((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-12).all())


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_seeded_draws_over_many_seeds_follow_the_tempered_softmax():
    params = [SamplingParams(temperature=0.8, seed=seed) for seed in range(DRAWS)]
    seqs = [_seq(p) for p in params]
    result = sample(LOGITS.expand(DRAWS, -1).clone(), seqs)
    freq = _frequencies(result.token_ids, len(LOGITS))
    assert _within_sampling_error(freq, torch.softmax(LOGITS / 0.8, dim=-1), DRAWS)


def test_one_seeded_request_draws_from_the_softmax_at_every_sample_index():
    # The stream of one request: output i is sampled at sample index i.
    params = SamplingParams(temperature=1.0, seed=2024)
    seqs = [_seq(params, output_offset=i) for i in range(DRAWS)]
    result = sample(LOGITS.expand(DRAWS, -1).clone(), seqs)
    freq = _frequencies(result.token_ids, len(LOGITS))
    assert _within_sampling_error(freq, torch.softmax(LOGITS, dim=-1), DRAWS)


def test_consecutive_seeded_draws_are_independent():
    # Outputs 0 and 1 of many requests: the joint frequencies of the pairs match p_a * p_b.
    logits = torch.tensor([1.0, 0.0, -0.5])
    probs = torch.softmax(logits, dim=-1)
    seqs = [_seq(SamplingParams(seed=s), output_offset=o) for s in range(DRAWS) for o in (0, 1)]
    tokens = sample(logits.expand(len(seqs), -1).clone(), seqs).token_ids
    pairs = [a * 3 + b for a, b in zip(tokens[::2], tokens[1::2])]
    assert _within_sampling_error(
        _frequencies(pairs, 9), torch.outer(probs, probs).flatten(), DRAWS
    )


def test_sampled_tokens_follow_the_filtered_distribution():
    # With top_p=0.75 only tokens 1, 2, 3 may ever be drawn, in proportion 0.4 : 0.3 : 0.15.
    seqs = [_seq(SamplingParams(top_p=0.75, seed=seed)) for seed in range(DRAWS)]
    result = sample(_probs().log().expand(DRAWS, -1).clone(), seqs)
    freq = _frequencies(result.token_ids, 5)
    assert freq[0] == 0 and freq[4] == 0
    expected = torch.tensor([0.0, 0.4, 0.3, 0.15, 0.0]) / 0.85
    assert _within_sampling_error(freq, expected, DRAWS)


def test_seeded_noise_does_not_depend_on_the_batch_or_row():
    cpu = torch.device("cpu")
    alone = seeded_noise([77], [5], 1000, cpu)
    batch = seeded_noise([1, 77, 2, 77], [5, 5, 0, 6], 1000, cpu)
    assert torch.equal(batch[1], alone[0])
    assert torch.equal(seeded_noise([77] * 3, [5] * 3, 1000, cpu), alone.expand(3, -1))


def test_seeded_noise_differs_across_sample_indexes_and_seeds():
    keys = [(0, 0), (0, 1), (1, 0), (2**32, 0), (-1, 0), (12345, 2**20)]
    noise = seeded_noise([s for s, _ in keys], [i for _, i in keys], 4096, torch.device("cpu"))
    assert bool((noise > 0).all() and noise.isfinite().all())
    for a in range(len(keys)):
        for b in range(a + 1, len(keys)):
            # Different keys give unrelated rows: hardly an entry in common.
            assert (noise[a] == noise[b]).float().mean() < 0.01, (keys[a], keys[b])


def test_seeded_tokens_do_not_depend_on_batch_companions():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=gen)
    seeded = SamplingParams(temperature=1.2, top_k=50, seed=31)
    alone = sample(logits[2:3].clone(), [_seq(seeded, output_offset=4)]).token_ids
    companions = [
        _seq(SamplingParams(temperature=0)),
        _seq(SamplingParams(temperature=0.7, repetition_penalty=1.3), token_ids=(5, 9)),
        _seq(seeded, output_offset=4),
        _seq(SamplingParams(temperature=1.0, logprobs=2)),
    ]
    torch.manual_seed(0)  # the unseeded rows' noise, which must not reach the seeded row
    assert sample(logits.clone(), companions).token_ids[2] == alone[0]
    torch.manual_seed(1)
    assert sample(logits.clone(), companions).token_ids[2] == alone[0]


def test_penalties_change_only_the_rows_and_tokens_they_name():
    # Prompt [1, 2], outputs [2, 3, 3].
    tokens = [1, 2, 2, 3, 3]
    plain = Sequence("plain", [1, 2], SamplingParams())
    openai = Sequence(
        "openai", [1, 2], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    )
    repeat = Sequence("repeat", [1, 2], SamplingParams(repetition_penalty=2.0))
    for seq in (plain, openai, repeat):
        for token in tokens[2:]:
            seq.append_token(token)
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0]]).repeat(3, 1)
    got = apply_penalties(logits.clone(), [plain, openai, repeat])
    assert torch.equal(got[0], logits[0])
    # Output counts: token 2 once, token 3 twice; prompt-only token 1 is not an output.
    assert got[1].tolist() == [1.0, 1.0, 1.0 - 0.5 - 0.25, -1.0 - 1.0 - 0.25, 1.0]
    # Every token seen in prompt or output: positive logits halved, negative ones doubled.
    assert got[2].tolist() == [1.0, 0.5, 0.5, -2.0, 1.0]


def test_logprobs_come_back_for_the_rows_that_ask():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=gen)
    seqs = [
        _seq(SamplingParams(temperature=0, logprobs=3)),
        _seq(SamplingParams(temperature=0)),
        _seq(SamplingParams(temperature=1.0, seed=8, logprobs=0)),
    ]
    result = sample(logits.clone(), seqs)
    expected = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[1] is None
    first, third = result.logprobs[0], result.logprobs[2]
    assert first["token"] == (result.token_ids[0], expected[0, result.token_ids[0]].item())
    top = expected[0].topk(3)
    assert first["top"] == list(zip(top.indices.tolist(), top.values.tolist()))
    assert third["token"] == (result.token_ids[2], expected[2, result.token_ids[2]].item())
    assert third["top"] == []


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


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 1.5}, {"frequency_penalty": 1.2}],
    ids=["presence", "frequency"],
)
def test_a_penalized_request_resumed_elsewhere_counts_its_earlier_outputs(llm, penalty):
    # Outputs streamed before a retry come back as part of the prompt; the penalties still count
    # them as outputs, so the resumed stream is the uninterrupted one.
    full = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **penalty)
    (whole,) = llm.generate([PROMPT], full)
    k = 8
    resumed_prompt = whole.prompt_token_ids + whole.token_ids[:k]
    rest = SamplingParams(max_tokens=24 - k, temperature=0, ignore_eos=True, **penalty)
    engine = llm.engine
    resumed = engine.add_request("resumed", resumed_prompt, rest, output_offset=k)
    forgetful = engine.add_request("forgetful", resumed_prompt, rest)  # counts none of them
    while engine.has_unfinished():
        engine.step()
    assert resumed.output_token_ids == whole.token_ids[k:]
    assert forgetful.output_token_ids != whole.token_ids[k:]


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
