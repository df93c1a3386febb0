"""Speculative decoding with a draft model (`pdserve.engine.spec_decode.draft_model`): the tokens of plain
decoding, greedy and seeded, with a draft that agrees with the target about half the time and with
the target drafting for itself (every greedy draft kept); the drafts are the draft model's own
greedy continuations (its KV caught up and rolled back exactly); preemption, chunked prefill and
aborts leave no block of either pool behind; a draft of another vocabulary is refused, naming
the difference; the scheduler gives back what it reserved for drafts not proposed; the draft's
pool takes draft_num_kv_blocks of the budget where given, and a pool too small for every sequence
leaves the rest decoding plainly; the draft's prefix cache spares a repeated prompt's catch-up,
holds KV of each sequence's own tokens only, and never frees a block another sequence shares."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import build_draft_checkpoint

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence

TARGET = "pdserve-stories"
STORY = (
    "Once upon a time, there was a little cat named Tom. Tom liked to play in the garden. "
    "One day, Tom saw a big red ball in the garden. "
)
PROMPTS = [STORY, STORY[:60], STORY[40:], "Lily had a red ball."]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = [
    SamplingParams(max_tokens=40, temperature=t, seed=s, ignore_eos=True)
    for t, s in ((0.7, 1), (1.0, 2), (0.7, 3), (1.0, 4))
]


def spec(model: str, k: int = 4, **keys: object) -> str:
    # No adaptive limit: every speculating sequence takes k drafts a step.
    return json.dumps(
        {
            "method": "draft_model",
            "model": model,
            "num_speculative_tokens": k,
            "adaptive": False,
            **keys,
        }
    )


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    """The target's first two layers of four: its greedy choice about half the time."""
    path = tmp_path_factory.mktemp("draft")
    return str(build_draft_checkpoint(resolve_model_dir(TARGET), path, num_layers=2))


@pytest.fixture(scope="module")
def plain() -> dict[str, list[list[int]]]:
    llm = LLM(TARGET, device="cpu")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    return {
        "prompts": prompts,
        "greedy": [o.token_ids for o in llm.generate(prompts, GREEDY)],
        "seeded": [o.token_ids for o in llm.generate(prompts, SEEDED)],
    }


def all_blocks_free(llm: LLM) -> bool:
    target, draft = llm.engine.block_manager, llm.engine.proposer.block_manager
    return target.num_free_blocks == target.num_blocks and draft.num_free_blocks == draft.num_blocks


def test_a_draft_model_gives_the_tokens_of_plain_decoding(plain, draft_dir):
    llm = LLM(TARGET, device="cpu", speculative_config=spec(draft_dir))
    assert [o.token_ids for o in llm.generate(plain["prompts"], GREEDY)] == plain["greedy"]
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert [o.token_ids for o in llm.generate(plain["prompts"], SEEDED)] == plain["seeded"]
    assert all_blocks_free(llm)


def test_the_target_drafting_for_itself_keeps_every_greedy_draft(plain):
    llm = LLM(TARGET, device="cpu", speculative_config=spec(TARGET))
    assert [o.token_ids for o in llm.generate(plain["prompts"], GREEDY)] == plain["greedy"]
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # Four drafts and the target's own token a step, but for the first and the last few.
    assert stats.num_steps <= 2 + 40 // 5 + 2
    assert all_blocks_free(llm)


def test_drafts_are_the_draft_models_greedy_continuations_whatever_was_rejected(plain, draft_dir):
    # The draft's KV is caught up with every accepted token and rolled back past every rejected
    # draft, so each proposal is exactly what the draft model alone continues the sequence with.
    # A step's budget of 16 tokens: the draft catches up with a prompt over several steps.
    llm = LLM(TARGET, device="cpu", speculative_config=spec(draft_dir), max_num_batched_tokens=16)
    proposer = llm.engine.proposer
    proposals: list[tuple[list[int], list[int]]] = []
    draft = proposer.draft

    def recording(batch):  # noqa: ANN001, ANN202
        drafts = draft(batch)
        proposals.extend((list(seq.token_ids), d) for (seq, _), d in zip(batch, drafts) if d)
        return drafts

    proposer.draft = recording
    engine, bs = llm.engine, proposer.block_manager.block_size
    for i, ids in enumerate(plain["prompts"]):
        engine.add_request(f"r{i}", ids, SEEDED[i])
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:  # the draft's KV holds the sequence's tokens only
            assert seq.num_draft_computed_tokens < seq.num_tokens
            assert len(seq.draft_block_table) == -(-seq.num_draft_computed_tokens // bs)
    assert engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    assert all_blocks_free(llm)
    alone = LLM(draft_dir, device="cpu")
    k = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    sample = proposals[:: max(1, len(proposals) // 24)]
    greedy = alone.generate([tokens for tokens, _ in sample], k)
    assert [d for _, d in sample] == [o.token_ids[: len(d)] for o, (_, d) in zip(greedy, sample)]


def test_preemption_chunking_and_aborts_leave_no_block_of_either_pool(plain, draft_dir):
    tight = dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=40)
    llm = LLM(TARGET, device="cpu", speculative_config=spec(draft_dir), **tight)
    engine = llm.engine
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    for rid, ids in zip(tokens, plain["prompts"]):
        engine.add_request(rid, ids, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        for seq in engine.scheduler.waiting:  # a preempted sequence holds no draft KV either
            assert not seq.draft_block_table and seq.num_draft_computed_tokens == 0
    assert list(tokens.values()) == plain["greedy"]
    assert engine.scheduler.num_preemptions > 0
    assert engine.proposer.num_cached_tokens > 0  # a prompt's draft blocks taken from the cache
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    assert all_blocks_free(llm)
    # An abort mid-speculation gives every block of both pools back.
    engine.add_request("a", plain["prompts"][0], GREEDY)
    seq = engine.seqs["a"]
    while not seq.draft_block_table or seq.num_output_tokens < 8:
        engine.step()
    assert not seq.is_finished
    assert engine.abort("a")
    assert all_blocks_free(llm)


def test_sequences_whose_draft_kv_does_not_fit_decode_plainly(plain, draft_dir):
    llm = LLM(TARGET, device="cpu", speculative_config=spec(draft_dir), block_size=8)
    proposer = llm.engine.proposer
    proposer.block_manager = BlockManager(9, 8, enable_prefix_caching=False)  # 72 draft tokens
    assert [o.token_ids for o in llm.generate(plain["prompts"], GREEDY)] == plain["greedy"]
    stats = llm.engine.stats
    # Some drafts, but far fewer than the 193 verified with room for every sequence's.
    assert 0 < stats.num_accepted_tokens and stats.num_draft_tokens < 100
    assert all_blocks_free(llm)


def test_a_draft_of_another_vocabulary_is_refused_naming_the_difference():
    with pytest.raises(ValueError, match=r"draft's tokenizer vocabulary differs .*784 tokens"):
        LLM("pdserve-tiny", device="cpu", speculative_config=spec(TARGET))


class ShortProposer:
    """Proposes fewer drafts than the scheduler reserved: one for every sequence."""

    def limit(self, seq, k):  # noqa: ANN001, ANN201
        return k

    def draft(self, batch):  # noqa: ANN001, ANN201
        return [[7] for _ in batch]

    def rollback(self, seq, num_valid):  # noqa: ANN001, ANN201
        pass

    def release(self, seq):  # noqa: ANN001, ANN201
        pass


def test_the_scheduler_gives_back_blocks_and_tokens_reserved_for_drafts_not_proposed():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, 8, 12, proposer=ShortProposer(), num_speculative_tokens=6)
    params = SamplingParams(max_tokens=20, temperature=0)
    decoding = Sequence("d", [5, 6, 7], params)
    sched.add(decoding)
    sched.postprocess(sched.schedule(), {0: 9}, 100)  # prefill: 4 tokens, one block
    sched.add(Sequence("w", list(range(10, 18)), params))
    out = sched.schedule()
    # It reserved 1 + 6 tokens (two blocks), took 1 + 1: the second block and 5 tokens back,
    # which the waiting prompt's 8 tokens then fit into.
    assert decoding.draft_token_ids == [7]
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 2), ("w", 8)]
    assert len(decoding.block_table) == 2  # tokens 4 and 5 at positions 3 and 4
    assert bm.num_free_blocks == 16 - 2 - 2


def test_a_tensor_parallel_target_drafts_on_rank_0(plain, draft_dir):
    # The draft model is whole on rank 0 (the other rank holds no draft): it proposes before
    # the step is published to the group.
    with LLM(
        TARGET, device="cpu", tensor_parallel_size=2, speculative_config=spec(draft_dir)
    ) as llm:
        tokens = [o.token_ids for o in llm.generate(plain["prompts"][:2], GREEDY)]
        assert llm.engine.stats.num_accepted_tokens > 0
        assert all_blocks_free(llm)
    assert tokens == plain["greedy"][:2]


# --- the draft's pool: its size, and its prefix cache --------------------------------------------


def test_draft_num_kv_blocks_sizes_the_draft_pool_and_the_target_takes_the_rest():
    budget = 16 << 20
    llm = LLM(TARGET, device="cpu", kv_cache_bytes=budget, speculative_config=spec(TARGET))
    target, draft = llm.engine.block_manager, llm.engine.proposer.block_manager
    per_target = llm.engine.layout.bytes_per_block
    per_draft = llm.engine.proposer.layout.bytes_per_block
    # Unset: as many blocks as the target's, out of the same budget.
    assert draft.num_blocks == target.num_blocks == budget // (per_target + per_draft)
    sized = spec(TARGET, draft_num_kv_blocks=100)
    llm = LLM(TARGET, device="cpu", kv_cache_bytes=budget, speculative_config=sized)
    assert llm.engine.proposer.block_manager.num_blocks == 100
    assert llm.engine.proposer.pool.num_blocks == 100
    assert llm.engine.block_manager.num_blocks == (budget - 100 * per_draft) // per_target
    # The target's explicit num_kv_blocks: the draft's pool is just its own size.
    llm = LLM(TARGET, device="cpu", num_kv_blocks=50, speculative_config=sized)
    assert llm.engine.block_manager.num_blocks == 50
    assert llm.engine.proposer.block_manager.num_blocks == 100
    whole = spec(TARGET, draft_num_kv_blocks=budget // per_draft)
    with pytest.raises(ValueError, match="leaves no block .* draft_num_kv_blocks"):
        LLM(TARGET, device="cpu", kv_cache_bytes=budget, speculative_config=whole)


def test_a_draft_pool_too_small_for_every_sequence_leaves_the_rest_decoding_plainly(
    plain, draft_dir
):
    small = spec(draft_dir, draft_num_kv_blocks=9)  # 72 draft tokens
    llm = LLM(TARGET, device="cpu", speculative_config=small, block_size=8)
    assert llm.engine.proposer.block_manager.enable_prefix_caching
    assert [o.token_ids for o in llm.generate(plain["prompts"], GREEDY)] == plain["greedy"]
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens and stats.num_draft_tokens < 100
    assert all_blocks_free(llm)


LONG = STORY * 3


def catch_up(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], int, int]:
    """One request's tokens, and the tokens its draft computed and took cached to catch up."""
    proposer = llm.engine.proposer
    computed, cached = proposer.num_catch_up_tokens, proposer.num_cached_tokens
    [out] = llm.generate([prompt], params)
    return (
        out.token_ids,
        proposer.num_catch_up_tokens - computed,
        proposer.num_cached_tokens - cached,
    )


@pytest.mark.parametrize("caching", [True, False])
def test_a_second_request_with_the_same_prompt_catches_up_after_its_cached_draft_blocks(
    draft_dir, caching
):
    options = dict(device="cpu", block_size=8, enable_prefix_caching=caching)
    llm = LLM(TARGET, speculative_config=spec(draft_dir), **options)
    prompt = llm.tokenizer.encode(LONG)
    expected = LLM(TARGET, **options).generate([prompt], GREEDY)[0].token_ids
    first, computed_first, cached_first = catch_up(llm, prompt, GREEDY)
    second, computed_second, cached_second = catch_up(llm, prompt, GREEDY)
    assert first == second == expected
    assert cached_first == 0 and computed_first >= len(prompt)
    if caching:
        # Every full block of the prompt but one token's: from the cache.
        assert cached_second == (len(prompt) - 1) // 8 * 8 >= 96
        assert computed_second <= computed_first - cached_second + 8
    else:
        assert cached_second == 0 and computed_second >= len(prompt)
    assert all_blocks_free(llm)


def registered_blocks(bm: BlockManager) -> dict[int, tuple[int, list[int]]]:
    """Each registered block's hash: (the block, every token of its prefix chain)."""
    by_hash = {bm.registered_hash(b): b for b in range(bm.num_blocks) if bm.key(b) is not None}
    chains = {}
    for h, block in by_hash.items():
        tokens: list[int] = []
        link: int | None = h
        while link is not None and link in by_hash:
            parent, own = bm.key(by_hash[link])
            tokens[:0] = own
            link = parent
        if link is None:  # the whole chain is still cached
            chains[h] = (block, tokens)
    return chains


def test_the_draft_cache_holds_kv_of_each_sequences_own_tokens_only(plain, draft_dir):
    # Seeded requests reject drafts; a step's budget of 16 tokens catches the draft up with a
    # prompt over several steps; each prompt comes twice, the second time from the cache.
    options = dict(device="cpu", block_size=8, max_num_batched_tokens=16)
    llm = LLM(TARGET, speculative_config=spec(draft_dir), **options)
    engine, proposer = llm.engine, llm.engine.proposer
    bm, bs = proposer.block_manager, 8
    alone = LLM(draft_dir, device="cpu", block_size=8)
    reference: dict[int, torch.Tensor] = {}  # hash: the draft model's own KV of its chain

    def check_cached_kv() -> None:
        # After every step, every cached block's KV is what the draft model alone computes
        # for the tokens of its chain.
        chains = registered_blocks(bm)
        new = [h for h in chains if h not in reference]
        if new:
            alone.generate([chains[h][1] for h in new], SamplingParams(max_tokens=1))
            theirs = registered_blocks(alone.engine.block_manager)
            for h in new:
                reference[h] = alone.engine.pool.kv[:, :, theirs[h][0]].clone()
        for h, (block, _) in chains.items():
            kv = proposer.pool.kv[:, :, block]
            assert torch.allclose(kv, reference[h], atol=1e-4), f"block {block}"

    tokens: dict[str, list[int]] = {}
    for round_ in range(2):
        for i, ids in enumerate(plain["prompts"]):
            engine.add_request(f"{round_}.{i}", ids, SEEDED[i])
            tokens[f"{round_}.{i}"] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            for seq in engine.scheduler.running:
                # A registered block of a sequence's table holds its own tokens, all computed.
                parent = None
                for i, block in enumerate(seq.draft_block_table):
                    key = bm.key(block)
                    if key is None:
                        break
                    assert key == (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                    assert (i + 1) * bs <= seq.num_draft_computed_tokens
                    parent = bm.registered_hash(block)
            check_cached_kv()
    for round_ in range(2):
        assert [tokens[f"{round_}.{i}"] for i in range(len(PROMPTS))] == plain["seeded"]
    assert engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    assert proposer.num_cached_tokens > 0
    assert len(reference) > 10
    assert all_blocks_free(llm)


def test_a_sequence_sharing_cached_draft_blocks_keeps_them_when_the_other_ends(plain, draft_dir):
    llm = LLM(TARGET, device="cpu", block_size=8, speculative_config=spec(draft_dir))
    engine, bm = llm.engine, llm.engine.proposer.block_manager
    prompt = llm.tokenizer.encode(LONG)
    expected = LLM(TARGET, device="cpu").generate([prompt], GREEDY)[0].token_ids
    engine.add_request("a", prompt, GREEDY)
    a = engine.seqs["a"]
    while not a.draft_block_table:
        engine.step()
    engine.add_request("b", prompt, GREEDY)
    b = engine.seqs["b"]
    tokens: list[int] = []
    while not b.draft_block_table:
        tokens += [t for out in engine.step() if out.request_id == "b" for t in out.new_token_ids]
    shared = [block for block in b.draft_block_table if block in a.draft_block_table]
    assert len(shared) == (len(prompt) - 1) // 8
    for _ in range(3):  # both roll back rejected drafts and catch up: the shared blocks stay
        assert [bm.ref_count(block) for block in shared] == [2] * len(shared)
        tokens += [t for out in engine.step() if out.request_id == "b" for t in out.new_token_ids]
    assert engine.abort("a")
    assert [bm.ref_count(block) for block in shared] == [1] * len(shared)
    assert b.draft_block_table[: len(shared)] == shared
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == "b" for t in out.new_token_ids]
    assert tokens == expected
    assert all_blocks_free(llm)
