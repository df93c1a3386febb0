"""On CUDA, the KV tiers' copies run on a side stream into and out of pinned host memory: the
second turns of chats the pool evicted load their prefixes back from the host tier (and from disk
under it) and give the tokens the same engine gives without tiers, and a block loaded back holds
the bytes it left with."""

from __future__ import annotations

import pytest
import torch
from test_kv_tiers import BLOCK, POOL, conversations, run, two_turns

from pdserve.cluster.block_hash import prefix_hashes
from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_engine(**options) -> LLMEngine:
    config = EngineConfig(
        device="cuda",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=POOL,
        max_num_batched_tokens=512,
        **options,
    )
    return LLMEngine(config)


@pytest.mark.parametrize("disk", [False, True])
def test_tiers_on_a_gpu_give_the_tokens_of_no_tiers(disk, tmp_path):
    plain = cuda_engine(kv_host_bytes=0)
    try:
        expected, _ = two_turns(plain, conversations())
    finally:
        plain.close()
    bpb = plain.layout.bytes_per_block
    options = {"kv_host_bytes": 1000 * bpb}
    if disk:
        options = {"kv_host_bytes": 24 * bpb, "kv_disk_path": str(tmp_path)}
    engine = cuda_engine(**options)
    try:
        assert engine.tiers is not None and engine.tiers.host.buffer.is_pinned()
        outputs, cached = two_turns(engine, conversations())
        assert outputs == expected
        assert all(n >= 14 * BLOCK for n in cached), cached
        assert engine.tiers.stats.failures == 0
        assert engine.block_manager.num_free_blocks == POOL
    finally:
        engine.close()


def test_a_gpu_block_loaded_back_holds_the_bytes_it_left_with():
    engine = cuda_engine(kv_host_bytes=1 << 24)
    try:
        prompt = conversations(1, 61, seed=5)[0]
        run(engine, prompt, "first")
        hashes = prefix_hashes(prompt, BLOCK)[:15]
        bm = engine.block_manager
        before = engine.pool.kv[:, :, [bm._cached[h] for h in hashes]].clone()
        for i, other in enumerate(conversations(3, 60, seed=6)):
            run(engine, other, f"other-{i}")
        engine.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished():
            engine.step()
        assert engine.tiers.stats.hit_blocks["host"] >= 14
        after = engine.pool.kv[:, :, [bm._cached[h] for h in hashes]]
        assert torch.equal(after, before)
    finally:
        engine.close()
