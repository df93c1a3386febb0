"""Speculative decoding by n-gram lookup (`pdserve.engine.spec_decode.speculation`): the tokens of plain
decoding, greedy and seeded, whatever is accepted; verification that samples each position as
plain decoding would (its distribution checked alone); rejected drafts leave no KV behind, in the
block table or in the prefix cache; preemption, chunked prefill, aborts and tensor parallelism
take speculating sequences as they are; the flag's JSON is checked where it is given."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.execution.executor import verify
from pdserve.engine.kv.block_manager import hash_block_tokens
from pdserve.engine.spec_decode.speculation import NgramProposer, SpeculativeConfig, accepted

# Every decoding sequence proposes up to 4 drafts each step (no adaptive limit), so that the
# tests verify many.
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
STORY = (
    "Once upon a time, there was a little cat named Tom. Tom liked to play in the garden. "
    "One day, Tom saw a big red ball in the garden. "
)


def run(model: str, prompts, params, speculative_config=None, **options):  # noqa: ANN001, ANN201
    options = {"device": "cpu", **options}
    llm = LLM(model, speculative_config=speculative_config, **options)
    if prompts and isinstance(prompts[0], str):
        prompts = [llm.tokenizer.encode(p) for p in prompts]
    return [o.token_ids for o in llm.generate(prompts, params)], llm


# --- the pieces alone ----------------------------------------------------------------------------


def test_the_proposer_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    propose = NgramProposer(SpeculativeConfig(3, prompt_lookup_max=3, prompt_lookup_min=1)).propose
    # The last 3 tokens (7, 8, 9) occurred twice; the later occurrence is continued.
    assert propose([7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 7, 8, 9], 3) == [3, 4, 5]
    assert propose([7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 7, 8, 9], 2) == [3, 4]
    # No 3- or 2-gram match: the 1-gram (9) is continued; near the end, fewer than k.
    assert propose([9, 5, 1, 2, 3, 9], 3) == [5, 1, 2]
    assert propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert propose([1, 2, 3, 4], 3) == []  # the last token never occurred before
    two = NgramProposer(SpeculativeConfig(3, prompt_lookup_max=3, prompt_lookup_min=2)).propose
    assert two([9, 5, 1, 2, 3, 9], 3) == []  # a 1-gram is below its minimum


def latest_continuation(token_ids: list[int], k: int, sizes: range) -> list[int]:
    """The proposal by a scan back from the end, longest n first."""
    length = len(token_ids)
    for n in reversed(sizes):
        for end in range(length - 2, n - 2, -1):
            if n < length and token_ids[end - n + 1 : end + 1] == token_ids[length - n :]:
                return token_ids[end + 1 : end + 1 + k]
    return []


def test_a_kept_index_proposes_what_a_scan_of_the_whole_context_finds():
    rng = random.Random(5)
    config = SpeculativeConfig(3, prompt_lookup_max=4, prompt_lookup_min=1)
    proposer = NgramProposer(config)
    for _ in range(20):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        index = proposer.new_index()
        for _ in range(40):  # the sequence grows a token or several at a time, as it decodes
            want = latest_continuation(tokens, 3, range(1, 5))
            assert proposer.propose(tokens, 3, index) == want
            assert proposer.propose(tokens, 3) == want  # a fresh index
            tokens += [rng.randrange(6) for _ in range(rng.choice([1, 1, 3]))]


def test_a_sequence_keeps_its_drafts_up_to_the_first_the_target_disagrees_with():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all, and the token after
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the target's own token at the miss
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accepted([], [3]) == [3]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON"),
        ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', "positive integer"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not supported"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "'draft_model' needs model"),
        (
            '{"model": "pdserve-tiny", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
            "prompt_lookup_max is the ngram method's",
        ),
        (
            '{"method": "ngram", "model": "pdserve-tiny", "num_speculative_tokens": 2}',
            "model is the draft_model method's",
        ),
        (
            '{"model": "pdserve-tiny", "num_speculative_tokens": 2, "draft_tp": 1}',
            "unknown key 'draft_tp'",
        ),
        (
            '{"model": "pdserve-tiny", "num_speculative_tokens": 2, '
            '"draft_tensor_parallel_size": 2}',
            "draft_tensor_parallel_size must be 1",
        ),
        (
            '{"num_speculative_tokens": 2, "draft_num_kv_blocks": 64}',
            "draft_num_kv_blocks is the draft_model method's",
        ),
        (
            '{"model": "pdserve-tiny", "num_speculative_tokens": 2, "draft_num_kv_blocks": 0}',
            "draft_num_kv_blocks must be a positive integer",
        ),
        (
            '{"model": "pdserve-tiny", "num_speculative_tokens": 2, "draft_num_kv_blocks": 1.5}',
            "draft_num_kv_blocks must be a positive integer",
        ),
        (
            '{"model": "pdserve-tiny", "num_speculative_tokens": 2, "draft_num_kv_blocks": true}',
            "draft_num_kv_blocks must be a positive integer",
        ),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"num_speculative_tokens": 0}', "must be a positive integer"),
        ('{"num_speculative_tokens": 2, "lookahead": 1}', "unknown key 'lookahead'"),
        (
            '{"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "prompt_lookup_min exceeds",
        ),
    ],
)
def test_a_malformed_speculative_config_is_refused_where_it_is_given(text, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=text)


def test_the_draft_pool_size_is_a_key_of_the_draft_model_method():
    text = '{"model": "pdserve-tiny", "num_speculative_tokens": 2, "draft_num_kv_blocks": 64}'
    assert SpeculativeConfig.parse(text).draft_num_kv_blocks == 64
    assert (
        SpeculativeConfig.parse(text.replace(', "draft_num_kv_blocks": 64', "")).draft_num_kv_blocks
        is None
    )


def test_verification_samples_each_position_from_the_targets_distribution():
    # Two positions of a speculating sequence whose draft is token 2: the first token kept must
    # follow p0 (2 with probability 0.4), and after an accepted draft the next must follow p1.
    # 20,000 unseeded verifications; a chi-square test per position at significance 1e-6 (the
    # statistic's tail beyond the bound below, for 4 degrees of freedom), so a correct sampler
    # fails this test about once in a million runs.
    torch.manual_seed(0)
    p0 = torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.5, 0.1])
    n = 20_000
    params = SamplingParams(max_tokens=8, temperature=1.0)
    seqs = [SimpleNamespace(draft_token_ids=[2], params=params, sample_index=0)] * n
    logits = torch.stack([p0.log(), p1.log()]).repeat(n, 1)
    result = verify(logits, list(range(n)), seqs)
    firsts = torch.tensor(result.token_ids)
    seconds = torch.tensor([more[0] for more in result.more_tokens.values()])
    assert result.num_drafts == n and result.num_accepted == len(seconds)
    bound = 33.4  # P(chi-square with 4 degrees of freedom > 33.4) < 1e-6

    def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
        counts = torch.bincount(samples, minlength=5).double()
        expected = p.double() * len(samples)
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi_square(firsts, p0) < bound
    assert chi_square(seconds, p1) < bound
    assert math.isclose(len(seconds) / n, 0.4, abs_tol=0.02)  # accepted as often as p0(2)


# --- in the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_speculation_gives_the_tokens_of_plain_decoding(temperature):
    # Greedy and seeded: the same tokens, with drafts accepted and rejected along the way.
    params = [
        SamplingParams(max_tokens=64, temperature=temperature, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    plain, _ = run("pdserve-stories", [STORY] * 4, params)
    spec, llm = run("pdserve-stories", [STORY] * 4, params, NGRAM)
    stats = llm.engine.stats
    assert spec == plain
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some rejected
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_a_batch_over_disable_by_batch_size_verifies_no_drafts():
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 20, 48, 64)
    ]
    plain, _ = run("pdserve-stories", [STORY] * 4, params)
    # The model drafting for itself: every step that may verify drafts does.
    config = json.dumps(
        {"model": "pdserve-stories", "num_speculative_tokens": 2, "disable_by_batch_size": 2}
    )
    llm = LLM("pdserve-stories", device="cpu", speculative_config=config)
    engine, ids = llm.engine, llm.tokenizer.encode(STORY)
    for i, p in enumerate(params):
        engine.add_request(str(i), ids, p)
    out: dict[str, list[int]] = {str(i): [] for i in range(4)}
    drafts_by_batch: dict[int, int] = {}
    while engine.has_unfinished():
        running, before = len(engine.scheduler.running), engine.stats.num_draft_tokens
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        drafts_by_batch[running] = drafts_by_batch.get(running, 0)
        drafts_by_batch[running] += engine.stats.num_draft_tokens - before
    assert [out[str(i)] for i in range(4)] == plain
    assert drafts_by_batch[4] == drafts_by_batch[3] == 0  # over 2 running: plain steps
    assert drafts_by_batch[2] > 0 and drafts_by_batch[1] > 0


def test_rejected_drafts_leave_no_blocks_and_never_reach_the_prefix_cache():
    rng = random.Random(3)
    base = [rng.randrange(4, 500) for _ in range(24)]
    prompts = [base * 3, base[:12] * 4, [rng.randrange(4, 500) for _ in range(9)] * 5]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    tokens, llm = run(
        "pdserve-tiny",
        prompts,
        params,
        NGRAM,
        num_kv_blocks=64,
        block_size=4,
        enable_prefix_caching=True,
    )
    bm = llm.engine.block_manager
    stats = llm.engine.stats
    assert stats.num_draft_tokens - stats.num_accepted_tokens >= 10  # many rejections
    assert bm.num_free_blocks == bm.num_blocks  # every block back
    # Every cached block is a block of some sequence's own tokens (prompt and output), never
    # one holding a rejected draft.
    allowed = set()
    for prompt, output in zip(prompts, tokens):
        full, parent = prompt + output, None
        for i in range(len(full) // 4):
            parent = hash_block_tokens(parent, tuple(full[4 * i : 4 * i + 4]))
            allowed.add(parent)
    assert bm.num_cached_blocks > 0
    assert set(bm._cached) <= allowed


def test_preemption_chunking_and_aborts_take_speculating_sequences_as_they_are():
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [STORY * 2, STORY, STORY[:60], STORY[40:]]
    tight = dict(num_kv_blocks=30, block_size=8, max_num_batched_tokens=40)
    plain, _ = run("pdserve-stories", prompts, params, num_kv_blocks=512)
    spec, llm = run("pdserve-stories", prompts, params, NGRAM, **tight)
    assert spec == plain
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.num_accepted_tokens > 0
    # An abort mid-speculation gives every block back.
    engine = llm.engine
    ids = llm.tokenizer.encode(STORY)
    engine.add_request("a", ids, params)
    drafts_before = engine.stats.num_draft_tokens
    seq = engine.seqs["a"]
    while engine.stats.num_draft_tokens == drafts_before or seq.num_output_tokens < 8:
        engine.step()
    assert not seq.is_finished
    assert engine.abort("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_tensor_parallel_group_speculates_alike():
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain, _ = run("pdserve-stories", [STORY] * 2, params)
    llm = LLM("pdserve-stories", device="cpu", tensor_parallel_size=2, speculative_config=NGRAM)
    with llm:
        ids = llm.tokenizer.encode(STORY)
        spec = [o.token_ids for o in llm.generate([ids] * 2, params)]
        assert llm.engine.stats.num_accepted_tokens > 0
    assert spec == plain
