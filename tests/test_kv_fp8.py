"""The FP8 KV cache (`kv_cache_dtype="fp8"`): a (token, KV head) row is stored as its FP8 values
then its float32 scale, inside the page. The row format against values computed by hand; the
scale is per token, so pages written in chunks equal pages written at once; the offline engine
really stores FP8 bytes (layer 0's pages are the quantized rows of the float32 cache's), gives
mostly the float32 cache's greedy tokens, the same tokens with and without prefix caching, and
through the host and disk tiers; pages move with their scales over tcp and shm, a corrupted
scale byte fails the digest, and a pool of another dtype refuses the pages. Models whose pages
hold more than K and V rows are refused by name."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from checkpoints import FAMILIES
from test_kv_transfer import blocks_bits, wait_result

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.config import ModelConfig
from pdserve.kernels import attention_ref, mla_ref
from pdserve.kernels.kv_fp8_ref import (
    FP8_KV_DTYPE,
    dequantize_rows,
    fp8_cache_ops,
    quantize_rows,
    read_blocks,
    store_kv,
)
from pdserve.kernels.ops import REFERENCE
from pdserve.kv_transfer import make_receiver, make_sender, pages
from pdserve.kv_transfer.base import KVSend
from pdserve.kv_transfer.faults import KVFaults

MODEL = "pdserve-stories"  # the embedded trained model: 4 layers, 2 KV heads of 32
HEAD_DIM = 32
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
NUM_BLOCKS = 16


def prompts(n: int, seed: int, lo: int = 8, hi: int = 48, vocab: int = 784) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def engine(**options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=MODEL, device="cpu", block_size=8, **options))


def run(eng: LLMEngine, prompt: list[int], request_id: str) -> tuple[list[int], int]:
    seq = eng.add_request(request_id, prompt, GREEDY)
    while eng.has_unfinished():
        eng.step()
    return seq.output_token_ids, seq.num_cached_tokens


# --- the row format ---------------------------------------------------------------------------


def test_a_row_is_its_fp8_values_over_its_amax_scale_then_the_scale():
    # amax 2: scale 2/448, the values become 224, -448, 112, 0: all exact in float8_e4m3fn
    # (sign, 4 exponent bits biased by 7, 3 mantissa bits): 0x76, 0xFE, 0x6E, 0x00.
    row = torch.tensor([[1.0, -2.0, 0.5, 0.0]])
    scale = struct.pack("<f", struct.unpack("<f", struct.pack("<f", 2.0))[0] / 448.0)
    scale = struct.pack("<f", struct.unpack("<f", scale)[0])  # rounded to float32
    assert bytes(quantize_rows(row)[0].tolist()) == bytes([0x76, 0xFE, 0x6E, 0x00]) + scale
    assert torch.equal(dequantize_rows(quantize_rows(row), torch.float32), row)
    zeros = quantize_rows(torch.zeros(1, 4))  # an all-zero row: zeros, scale 1.0
    assert bytes(zeros[0].tolist()) == bytes(4) + struct.pack("<f", 1.0)


def test_rows_round_trip_within_fp8_precision_and_each_row_has_its_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, HEAD_DIM, generator=g) * torch.logspace(-3, 3, 64).view(-1, 1, 1)
    rows = quantize_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 2, HEAD_DIM + 4)
    back = dequantize_rows(rows, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # 3 mantissa bits: half a step is 1/16 of the value, at most amax/16.
    assert bool(((back - x).abs() <= amax / 16).all())
    scales = rows[..., HEAD_DIM:].contiguous().view(torch.float32).squeeze(-1)
    assert torch.allclose(scales, amax.squeeze(-1) / 448)


def test_tokens_stored_in_chunks_give_the_same_pages_as_stored_at_once():
    # A per-block or per-call scale would change a token's bytes with what shares its block.
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(11, 2, HEAD_DIM, generator=g) * torch.arange(1, 12).view(-1, 1, 1)
    values = torch.randn(11, 2, HEAD_DIM, generator=g)
    slots = torch.arange(3, 14)
    caches = []
    for cuts in ([0, 11], [0, 2, 7, 11], [0, 5, 6, 11]):
        k_cache = torch.zeros(4, 4, 2, HEAD_DIM + 4, dtype=torch.uint8)
        v_cache = torch.zeros_like(k_cache)
        for a, b in zip(cuts, cuts[1:]):
            store_kv(keys[a:b], values[a:b], k_cache, v_cache, slots[a:b])
        caches.append((k_cache, v_cache))
    for k_cache, v_cache in caches[1:]:
        assert torch.equal(k_cache, caches[0][0]) and torch.equal(v_cache, caches[0][1])


def test_attention_over_fp8_pages_is_attention_over_their_dequantized_values():
    g = torch.Generator().manual_seed(2)
    k_cache = quantize_rows(torch.randn(6, 4, 2, HEAD_DIM, generator=g))
    v_cache = quantize_rows(torch.randn(6, 4, 2, HEAD_DIM, generator=g))
    k, v = dequantize_rows(k_cache, torch.float32), dequantize_rows(v_cache, torch.float32)
    query = torch.randn(2, 4, HEAD_DIM, generator=g)
    args = (torch.tensor([7, 11]), torch.tensor([0, 1, 2]), 0.2, 1)
    attend = fp8_cache_ops(REFERENCE).paged_attention
    tables = torch.tensor([[5, 2, -1], [4, 0, 3]], dtype=torch.int32)
    want = attention_ref.paged_attention(query, k, v, tables, *args)
    assert torch.equal(attend(query, k_cache, v_cache, tables, *args), want)
    # A window of 4: sequence 1 reads from position 7 on, its first block is given back (-1).
    tables = torch.tensor([[5, 2, -1], [-1, 0, 3]], dtype=torch.int32)
    ids, renumbered = read_blocks(tables)
    assert ids.tolist() == [0, 2, 3, 5] and renumbered.tolist() == [[3, 1, -1], [-1, 0, 2]]
    want = attention_ref.paged_attention(query, k, v, tables, *args, window=4)
    assert torch.equal(attend(query, k_cache, v_cache, tables, *args, window=4), want)


# --- the layout ---------------------------------------------------------------------------------


def test_an_fp8_layout_stores_bytes_with_a_scale_per_token_and_head():
    fp8 = KVLayout(4, 16, 2, HEAD_DIM, FP8_KV_DTYPE)
    bf16 = KVLayout(4, 16, 2, HEAD_DIM, "bfloat16")
    assert fp8.torch_dtype == torch.uint8 and fp8.page_width == HEAD_DIM + 4
    # per token per layer: 2 * kv_heads * (head_dim + 4) against 2 * kv_heads * head_dim * 2
    assert fp8.bytes_per_block == 4 * 16 * 2 * 2 * (HEAD_DIM + 4)
    assert fp8.bytes_per_block / bf16.bytes_per_block == (HEAD_DIM + 4) / (2 * HEAD_DIM)
    assert KVPool(fp8, 3).kv.shape == (4, 2, 3, 16, 2, HEAD_DIM + 4)
    with pytest.raises(ValueError, match="'dtype'"):
        bf16.check_compatible(fp8, ignore=("num_kv_heads",))


@pytest.mark.parametrize("family", ["qwen3_next", "gemma4_text"])
def test_models_whose_pages_hold_more_than_k_and_v_rows_refuse_fp8_by_name(family):
    cfg = ModelConfig.from_dict(dict(FAMILIES[family]))  # the tiny checkpoints' configs
    with pytest.raises(ValueError, match=f"^kv_cache_dtype fp8: {cfg.model_type}'s"):
        KVLayout.for_model(cfg, 16, FP8_KV_DTYPE)
    KVLayout.for_model(cfg, 16, "float32")  # the model's dtype is fine


def test_latent_attention_over_fp8_pages_is_over_their_dequantized_latents():
    g = torch.Generator().manual_seed(3)
    cache = quantize_rows(torch.randn(5, 4, 1, 40, generator=g))  # MLA: one row of L + R
    tables = torch.tensor([[4, 1], [2, -1]], dtype=torch.int32)
    query = torch.randn(3, 4, 40, generator=g)
    args = (tables, torch.tensor([6, 3]), torch.tensor([0, 2, 3]), 0.3, 2, 32)
    want = mla_ref.latent_attention(query, dequantize_rows(cache, torch.float32), *args)
    assert torch.equal(fp8_cache_ops(REFERENCE).latent_attention(query, cache, *args), want)


def test_mla_keeps_its_latent_rows_in_fp8_with_one_scale_per_token(checkpoint_dir):
    model = str(checkpoint_dir("deepseek_v2"))
    options = dict(device="cpu", num_kv_blocks=128, block_size=8)
    plain, fp8 = LLM(model, **options), LLM(model, kv_cache_dtype="fp8", **options)
    width = plain.engine.layout.head_dim  # kv_lora_rank + qk_rope_head_dim
    assert fp8.engine.pool.kv.shape[1:] == (1, 128, 8, 1, width + 4)
    batch = prompts(12, seed=8, lo=8, hi=40, vocab=500)
    first = SamplingParams(max_tokens=1, temperature=0)
    want = [o.token_ids for o in plain.generate(batch[:1], first)]
    got = [o.token_ids for o in fp8.generate(batch[:1], first)]
    n = len(batch[0])  # layer 0's latents come from the prompt alone: the same floats
    stored = fp8.engine.pool.kv[0, 0].flatten(0, 1)[:n]
    assert torch.equal(stored, quantize_rows(plain.engine.pool.kv[0, 0].flatten(0, 1)[:n]))
    want = [o.token_ids[0] for o in plain.generate(batch, first)]
    got = [o.token_ids[0] for o in fp8.generate(batch, first)]
    share = sum(a == b for a, b in zip(want, got)) / len(batch)
    print(f"MLA fp8 cache (tiny random deepseek_v2): first tokens equal {share:.0%}")
    assert share >= 0.6  # a random tiny model's logits are close: FP8 flips some


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


# --- the offline engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    return (
        LLM(MODEL, device="cpu", num_kv_blocks=256, block_size=8),
        LLM(MODEL, device="cpu", num_kv_blocks=256, block_size=8, kv_cache_dtype="fp8"),
    )


def test_the_fp8_pool_holds_the_quantized_rows_of_the_float_pool():
    plain = LLM(MODEL, device="cpu", num_kv_blocks=8, block_size=8)
    fp8 = LLM(MODEL, device="cpu", num_kv_blocks=8, block_size=8, kv_cache_dtype="fp8")
    assert fp8.engine.pool.kv.dtype == torch.uint8
    assert fp8.engine.pool.kv.shape[-1] == HEAD_DIM + 4
    prompt = prompts(1, seed=3, lo=30, hi=31)[0]  # 30 tokens: blocks 0..3 of a fresh pool
    for llm in (plain, fp8):
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    # Layer 0's K and V come from the prompt alone, so they are the same floats in both
    # engines: the FP8 pool holds exactly their quantized rows, scales included.
    flat = plain.engine.pool.kv[0].flatten(1, 2)[:, :30]  # [planes, tokens, heads, head_dim]
    stored = fp8.engine.pool.kv[0].flatten(1, 2)[:, :30]
    assert torch.equal(stored, quantize_rows(flat))


def test_greedy_tokens_mostly_equal_the_float_cache_s(pair):
    plain, fp8 = pair
    batch = prompts(24, seed=4)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    got = [o.token_ids for o in fp8.generate(batch, GREEDY)]
    first = sum(a[0] == b[0] for a, b in zip(want, got)) / len(batch)
    equal = sum(x == y for a, b in zip(want, got) for x, y in zip(a, b))
    print(f"fp8 cache: first tokens equal {first:.0%}, all tokens {equal / 16 / len(batch):.0%}")
    assert first >= 0.9
    assert got != [a[:1] + [0] * 15 for a in want]  # it generates, not just starts alike
    assert sum(a == b for a, b in zip(want, got)) >= len(batch) // 3


def test_a_prefix_cached_or_chunked_sequence_gives_the_uncached_tokens():
    batch = prompts(4, seed=5, lo=30, hi=50)
    uncached = engine(num_kv_blocks=128, kv_cache_dtype="fp8", enable_prefix_caching=False)
    want = [run(uncached, p, f"u{i}")[0] for i, p in enumerate(batch)]
    cached = engine(num_kv_blocks=128, kv_cache_dtype="fp8", max_num_batched_tokens=13)
    for i, p in enumerate(batch):
        assert run(cached, p, f"a{i}")[0] == want[i]  # chunks of 13 across blocks of 8
        again, hit = run(cached, p, f"b{i}")
        assert hit >= 8 * (len(p) // 8 - 1) and again == want[i]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_blocks_evicted_to_a_tier_and_loaded_back_give_the_same_tokens(tier, tmp_path):
    convs = prompts(5, seed=6, lo=56, hi=57)
    plain = engine(num_kv_blocks=24, kv_cache_dtype="fp8", kv_host_bytes=0)
    want = [run(plain, p, f"p{i}")[0] for i, p in enumerate(convs)]
    options = {"kv_host_bytes": 1 << 20}
    if tier == "disk":
        options = {"kv_host_bytes": 8 * plain.layout.bytes_per_block, "kv_disk_path": str(tmp_path)}
    tiered = engine(num_kv_blocks=24, kv_cache_dtype="fp8", **options)
    for i, p in enumerate(convs):
        assert run(tiered, p, f"t{i}")[0] == want[i]
    for i, p in enumerate(convs):  # the pool of 24 blocks long evicted the first ones
        out, hit = run(tiered, p, f"again{i}")
        assert out == want[i]
    assert tiered.tiers.stats.hit_blocks[tier] >= 6 and tiered.tiers.stats.failures == 0
    stats = tiered.tiers.stats
    assert stats.loaded_bytes[tier] == stats.hit_blocks[tier] * tiered.layout.bytes_per_block
    tiered.close()
    plain.close()


# --- pages that move ------------------------------------------------------------------------------


def fp8_pool(heads: int = 2, seed: int = 7) -> KVPool:
    """A pool of quantized random rows (scales of every magnitude)."""
    lay = KVLayout(3, 4, heads, HEAD_DIM, FP8_KV_DTYPE)
    g = torch.Generator().manual_seed(seed)
    shape = pages.pool_shape(lay, NUM_BLOCKS)[:-1] + (HEAD_DIM,)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 100
    return KVPool(lay, NUM_BLOCKS, kv=quantize_rows(x))


class ScaleByteFault(KVFaults):
    """Flips the top byte of one landed row's scale (its exponent): the value is now wrong by
    a power of two, the FP8 bytes untouched."""

    def in_flight(self, parts: list[torch.Tensor]) -> None:
        parts[0].view(-1).view(torch.uint8)[HEAD_DIM + 3].bitwise_xor_(0x10)  # row 0's scale
        self.injected += 1

    def after_landing(self, kv, dst, layers, heads) -> None:  # noqa: ANN001
        kv[layers[0], 0, dst[0], 0, 0, HEAD_DIM + 3 : HEAD_DIM + 4].bitwise_xor_(0x10)
        self.injected += 1


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pages_move_with_their_scales_and_a_flipped_scale_byte_fails_the_digest(transport):
    pool = fp8_pool()
    with make_receiver(transport, pool.layout, NUM_BLOCKS) as receiver:
        with make_sender(transport, pool, chunk_bytes=1000) as sender:
            sender.connect("decode-0", receiver.info())
            receiver.expect("t-ok", [8, 9, 10])
            sender.send(KVSend("t-ok", "decode-0", [1, 2, 5], [8, 9, 10]))
            assert wait_result(receiver, "t-ok", 10.0).ok
            assert blocks_bits(receiver.pool.kv, [8, 9, 10]) == blocks_bits(pool.kv, [1, 2, 5])
            receiver._landing.faults = ScaleByteFault()
            receiver.expect("t-bad", [11, 12])
            sender.send(KVSend("t-bad", "decode-0", [3, 4], [11, 12]))
            result = wait_result(receiver, "t-bad", 10.0)
            assert receiver._landing.faults.injected >= 1
            assert not result.ok and "KV integrity check failed" in result.error
            assert not wait_result(sender, "t-bad", 10.0).ok


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_two_prefill_ranks_fill_one_fp8_pool_by_heads_scales_with_their_heads(transport):
    # Prefill TP=2 (1 head each) into decode TP=1 (2 heads): each head's rows carry its scales.
    receiver = make_receiver(transport, fp8_pool(2).layout, NUM_BLOCKS)
    ranks = [fp8_pool(1, seed) for seed in (8, 9)]
    senders = [make_sender(transport, pool, chunk_bytes=500) for pool in ranks]
    try:
        receiver.expect("t", [6, 7], timeout_s=20)
        for rank, sender in enumerate(senders):
            sender.connect("d", receiver.info())
            sender.send(KVSend("t", "d", [2, 3], [6, 7], dst_heads=(rank, rank + 1), timeout_s=20))
            assert wait_result(sender, "t", 20).ok
        assert wait_result(receiver, "t", 20).ok
        for rank, pool in enumerate(ranks):
            landed = receiver.pool.kv[:, :, [6, 7], :, rank : rank + 1]
            assert torch.equal(landed, pool.kv[:, :, [2, 3]])
    finally:
        for endpoint in (*senders, receiver):
            endpoint.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("other", ["bfloat16", "float32"])
def test_a_pool_of_another_dtype_refuses_fp8_pages(transport, other):
    pool = fp8_pool()
    plain = KVLayout(3, 4, 2, HEAD_DIM, other)
    with make_receiver(transport, plain, NUM_BLOCKS) as receiver:
        with make_sender(transport, pool) as sender:
            with pytest.raises(ValueError, match=f"field 'dtype': '{FP8_KV_DTYPE}' != '{other}'"):
                sender.connect("decode-0", receiver.info())  # checked by the sender
            forged = {**receiver.info(), "layout": pool.layout.to_dict()}
            sender.connect("decode-0", forged)  # checked by the receiver, in the handshake
            sender.send(KVSend("t-forged", "decode-0", [0], [1]))
            result = wait_result(sender, "t-forged", 10.0)
            assert not result.ok and "refused" in result.error and "'dtype'" in result.error
