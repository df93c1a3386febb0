"""The step loop: a mixed workload with chunked prefill, shared prefixes and preemption gives the
same greedy tokens as each request alone; aborts and prefix caching keep block accounting exact."""

from __future__ import annotations

import random

import pytest
from conftest import COMPILE

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestRejected

BLOCK = 4
pytestmark = pytest.mark.usefixtures("steps_really_compiled")


def make_engine(**overrides) -> LLMEngine:
    options = dict(block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=512, compile=COMPILE)
    options.update(overrides)
    return LLMEngine(EngineConfig(**options))


def run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    seq = engine.add_request(f"alone-{random.random()}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids


def mixed_workload(seed: int = 7):
    rng = random.Random(seed)
    shared = [rng.randrange(4, 500) for _ in range(21)]
    requests = []
    for i in range(10):
        own = [rng.randrange(4, 500) for _ in range(rng.randrange(1, 30))]
        prompt = (shared + own) if i % 2 == 0 else own + shared[:5]
        params = SamplingParams(max_tokens=rng.randrange(4, 20), temperature=0, ignore_eos=True)
        requests.append((f"req-{i}", prompt, params, rng.randrange(0, 12)))  # arrival step
    return requests


def test_mixed_workload_with_preemption_and_chunking_matches_each_request_alone():
    requests = mixed_workload()
    reference = make_engine()
    expected = {rid: run_alone(reference, p, sp) for rid, p, sp, _ in requests}

    # 24 blocks of 4 tokens cannot hold all ten at once, and 10-token steps split every prompt.
    engine = make_engine(num_kv_blocks=24, max_num_batched_tokens=10)
    seqs = {}
    step = 0
    pending = sorted(requests, key=lambda r: r[3])
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            seqs[rid] = engine.add_request(rid, prompt, params)
        engine.step()
        step += 1
        assert step < 2000, "the step loop stopped making progress"
    assert engine.scheduler.num_preemptions > 0
    assert {rid: s.output_token_ids for rid, s in seqs.items()} == expected
    assert engine.block_manager.num_free_blocks == 24


def test_oldest_request_is_never_preempted():
    engine = make_engine(num_kv_blocks=12, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    oldest = engine.add_request("oldest", list(range(10, 22)), params)
    engine.step()
    others = [engine.add_request(f"r{i}", list(range(30 + i, 42 + i)), params) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert oldest.num_preemptions == 0
    assert sum(s.num_preemptions for s in others) > 0
    assert all(s.num_output_tokens == 20 for s in [oldest, *others])


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_abort_frees_every_block(phase):
    engine = make_engine(max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    victim = engine.add_request("victim", list(range(5, 45)), params)
    bystander = engine.add_request("bystander", list(range(50, 60)), params)
    engine.step()  # 8 of the victim's 40 prompt tokens
    if phase == "decode":
        while victim.num_output_tokens < 3:
            engine.step()
    else:
        assert victim.num_computed_tokens < victim.num_prompt_tokens
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort("victim")
    assert victim.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert bystander.num_output_tokens == 50
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_hit_computes_only_the_suffix():
    engine = make_engine()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prefix = list(range(100, 141))  # 41 tokens: 10 full blocks of 4
    first = run_alone(engine, prefix + [7, 8, 9], params)
    before = engine.scheduler.num_prefill_tokens_computed
    seq = engine.add_request("second", prefix + [7, 8, 9], params)
    while engine.has_unfinished():
        engine.step()
    computed = engine.scheduler.num_prefill_tokens_computed - before
    assert seq.num_cached_tokens == 40  # 11 full blocks would cover 44 = the whole prompt
    assert computed == 44 - 40
    assert seq.output_token_ids == first
    assert engine.block_manager.prefix_hits >= 10
    cold = make_engine(enable_prefix_caching=False)
    assert run_alone(cold, prefix + [7, 8, 9], params) == first


def test_static_policy_admits_nothing_until_its_batch_finishes():
    engine = make_engine(scheduling_policy="static", max_num_seqs=2)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a = engine.add_request("a", [11, 12, 13], short)
    b = engine.add_request("b", [21, 22, 23], long)
    c = engine.add_request("c", [31, 32, 33], short)
    steps_until_c_started = 0
    while c.num_computed_tokens == 0:
        engine.step()
        steps_until_c_started += 1
    assert a.is_finished and b.is_finished  # c waited for the whole batch, not just a free seat
    while engine.has_unfinished():
        engine.step()
    continuous = make_engine()
    assert c.output_token_ids == run_alone(continuous, [31, 32, 33], short)
    assert b.output_token_ids == run_alone(continuous, [21, 22, 23], long)


def test_request_longer_than_context_is_rejected_at_add_request():
    engine = make_engine(max_model_len=32)
    with pytest.raises(RequestRejected, match="context"):
        engine.add_request("too-long", list(range(4, 40)), SamplingParams())
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_generation_stops_at_max_model_len():
    engine = make_engine(max_model_len=24)
    seq = engine.add_request(
        "r", list(range(4, 20)), SamplingParams(max_tokens=100, ignore_eos=True)
    )
    while engine.has_unfinished():
        engine.step()
    assert seq.num_tokens == 24 and seq.finish_reason == "length"


def test_prompts_wait_while_handoffs_hold_the_pool():
    # A prefill node whose blocks all wait for their KV handoff: new prompts queue, they
    # do not fail, and they run once a handoff releases its blocks.
    engine = make_engine(num_kv_blocks=8, max_model_len=32)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"held-{i}", list(range(10 + i, 26 + i)), params, prefill_only=True)
    held = {}
    while engine.has_unfinished():
        for out in engine.step():
            held[out.request_id] = out.held_tables[0]
    # Each left the engine with its KV in 4 blocks (16 prompt tokens + its first token).
    assert sorted(held) == ["held-0", "held-1"] and all(len(b) == 4 for b in held.values())
    assert not engine.seqs and engine.block_manager.num_free_blocks == 0
    late = engine.add_request("late", list(range(40, 50)), params)
    for _ in range(3):
        engine.step()
    assert late.num_computed_tokens == 0 and not late.is_finished
    engine.block_manager.free(held["held-0"])  # its handoff ended
    while engine.has_unfinished():
        engine.step()
    assert late.num_output_tokens == 4
    engine.block_manager.free(held["held-1"])
    assert engine.block_manager.num_free_blocks == 8
