"""What models whose layers keep different state save in KV: the bytes a prompt's handoff moves, and
the conversations one pool holds, each beside the same model with every layer full attention.

Five shapes, bfloat16, their layer kinds as transformers' configs build them: in 16-token blocks,
gpt-oss-20b (24 layers alternating sliding 128 / full, 8 KV heads of 64), Gemma-3-27B (62 layers,
five sliding 1024 to one full, 16 KV heads of 128) and Llama-4-Scout (48 layers, chunked 8192 on
three of four, full (NoPE) on every fourth, 8 KV heads of 128); and two linear hybrids, three
Gated DeltaNet layers to one full attention layer, with transformers' config defaults:
Qwen3-Next-80B-A3B (`Qwen3NextConfig()`: 48 layers, 2 KV heads of 256) and Qwen3.5-9B
(`Qwen3_5TextConfig()`: 32 layers, 4 KV heads of 256), linear layers of 16 key and 32 value heads
of 128, a convolution of 4. A linear layer keeps its state in its page of one block, so their
blocks are `fitted_block_size` tokens (544 and 272), while the all-full model they are set beside
(the dense model of their width and depth, every layer attention of their KV heads) keeps 16.

**Handoff.** For each prompt length, a sequence runs through a prefill-side KV manager as the
scheduler drives it (chunks of at most max_num_batched_tokens: allocate_slots, the chunk computed,
cache_full_blocks, release_unread), in a pool sized by the manager's own `peak_blocks`; a
decode-side manager reserves the arriving KV (allocate_arriving) in a pool of exactly the blocks
`handoff_blocks` lists; a real transport (tcp: make_sender / make_receiver, both in this process)
moves those blocks, and the pages that landed are checked bit for bit against the sender's. The
hybrid and the all-full layout of a case alternate round by round (median of --repeats rounds
after a warm-up, timed from send() to the sender seeing the receiver's ack). A case whose four
pools (both sides, both layouts) exceed --memory-gib (or the host's available memory) is measured
with fewer KV heads, halved until it fits, and says so: bytes scale with the heads exactly, so
bytes per token are given for the model's own heads. A linear hybrid's linear heads are cut
alike (a tensor-parallel rank's share), so its state still fits a page of the same block size.

**Prefix cache.** A prompt left behind keeps each KV group's blocks, a block per block_size
tokens: a full group's KV, a linear group's state at each block boundary (a snapshot that a later
prompt sharing the prefix resumes from). Bytes per cached token follow from the layout, and the
blocks are counted after the prompt ran in a pool with room for them.

**Capacity.** How many conversations of --conversation-tokens prompt tokens and --decode-tokens
decoded ones one pool of --pool-gib holds: each arrives as a handoff (allocate_arriving) and
decodes token by token (allocate_slots, cache_full_blocks, release_unread) while the earlier ones
keep their blocks, until an allocation fails; beside it the count `peak_blocks` gives (the pool's
blocks over one sequence's peak), which the measured count must meet.

    python -m pdserve.bench.hybrid_kv --out bench/results/hybrid_kv.json
    python -m pdserve.bench.hybrid_kv --models gpt-oss-20b --tokens 8192 --repeats 1
    python -m pdserve.bench.hybrid_kv --models Qwen3-Next-80B-A3B Qwen3.5-9B \
        --out bench/results/hybrid_kv_linear.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import zmq

from pdserve.bench.kv_transfer import available_bytes, measure, per_round
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.kv.kv_manager import KVCacheManager, handoff_blocks
from pdserve.engine.kv.layer_kinds import LinearState
from pdserve.engine.kv.state_pages import LinearStateShape, fitted_block_size
from pdserve.engine.models.config import LinearAttention, ModelConfig
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import KVSend, make_receiver, make_sender
from pdserve.tune import provenance
from pdserve.tune.remote_endpoint import wait_for

PARAMS = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
TIMEOUT_S = 300.0
SHARED = (
    "a shared machine: other engineers' tests ran beside this run on its 2 cores (the load "
    "averages say how much)"
)


def all_full(layout: KVLayout) -> KVLayout:
    """The same model with every layer full attention: one KV group, a slot per layer."""
    return replace(layout, layer_kinds=())


@dataclass(frozen=True, slots=True)
class Case:
    """A model as the bench measures it: its KV layout, the same model with every layer full
    attention, and, for a linear hybrid, the config its linear layers' state comes from."""

    hybrid: KVLayout
    all_full: KVLayout
    linear: ModelConfig | None = None
    tokens: tuple[int, ...] = (8192, 32768)  # the prompt lengths measured unless told others

    @classmethod
    def of_attention(cls, layout: KVLayout) -> Case:
        """Windowed or chunked layers beside full ones: all full is the same pages, one group."""
        return cls(layout, all_full(layout))

    @classmethod
    def of_linear(cls, cfg: ModelConfig, block_size: int = 16, dtype: str = "bfloat16") -> Case:
        """A linear hybrid: its pool's block size raised until a page holds a linear layer's
        state (`fitted_block_size`); all full is the dense model of its width and depth, every
        layer attention of its KV heads, at the requested block size."""
        hybrid = KVLayout.for_model(cfg, fitted_block_size(cfg, block_size), dtype)
        dense = replace(cfg, layer_kinds=(), linear_attention=None)
        full = KVLayout.for_model(dense, block_size, dtype)
        return cls(hybrid, full, cfg, (2048, 8192, 32768))

    def state_at(self, heads: int) -> LinearStateShape | None:
        """The linear state laid over `heads` pool heads: the linear heads shrunk in proportion
        (what one of num_kv_heads / heads tensor-parallel ranks holds), so the same block size
        holds it; None for a model without linear layers. Raises ValueError where the linear
        heads do not divide so."""
        if self.linear is None:
            return None
        model_heads = self.hybrid.num_kv_heads
        if model_heads % heads:
            raise ValueError(f"{heads} KV heads do not divide the model's {model_heads}")
        state = LinearStateShape.for_model(self.linear, model_heads // heads)
        if state.min_block_size() > self.hybrid.block_size:
            raise ValueError(f"a linear state at {heads} KV heads exceeds a page")
        return state

    def measurable_at(self, heads: int) -> bool:
        try:
            self.state_at(heads)
        except ValueError:
            return False
        return True


def gpt_oss_20b() -> Case:
    """transformers' GptOssConfig: layer i sliding if (i + 1) % 2, else full."""
    kinds = tuple("sliding 128" if (i + 1) % 2 else "full" for i in range(24))
    return Case.of_attention(KVLayout(24, 16, 8, 64, "bfloat16", layer_kinds=kinds))


def gemma3_27b() -> Case:
    """transformers' Gemma3TextConfig: layer i sliding if (i + 1) % sliding_window_pattern (6)."""
    kinds = tuple("sliding 1024" if (i + 1) % 6 else "full" for i in range(62))
    return Case.of_attention(KVLayout(62, 16, 16, 128, "bfloat16", layer_kinds=kinds))


def llama4_scout() -> Case:
    """transformers' Llama4TextConfig: layer i chunked (with RoPE) if (i + 1) % 4, else full
    attention without positions (NoPE)."""
    kinds = tuple("chunked 8192" if (i + 1) % 4 else "full" for i in range(48))
    return Case.of_attention(KVLayout(48, 16, 8, 128, "bfloat16", layer_kinds=kinds))


def gated_deltanet_hybrid(
    model_type: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    linear: LinearAttention,
    head_dim: int = 256,
) -> ModelConfig:
    """A Qwen3-Next / Qwen3.5 shape: layer i linear (Gated DeltaNet) if (i + 1) %
    full_attention_interval (4), else full attention of kv_heads heads of head_dim."""
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e7,  # rope, norms, vocabulary and MLP: not read by the KV
        rope_scaling=None,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        qk_norm=True,
        torch_dtype="bfloat16",
        bos_token_id=None,
        eos_token_ids=(),
        layer_kinds=tuple("linear" if (i + 1) % 4 else "full" for i in range(layers)),
        linear_attention=linear,
    )


def qwen3_next_80b() -> Case:
    """transformers' Qwen3NextConfig() defaults: 48 layers of 2048, 2 KV heads; linear layers of
    16 key and 32 value heads of 128, a convolution of 4."""
    linear = LinearAttention(16, 32, 128, 128, 4)
    return Case.of_linear(
        gated_deltanet_hybrid("qwen3_next", 48, 2048, 16, 2, 151936, 5632, linear)
    )


def qwen3_5_9b() -> Case:
    """transformers' Qwen3_5TextConfig() defaults (its docstring's "Qwen3.5-9B style", and
    Qwen3.5-9B's published shape): 32 layers of 4096, 4 KV heads; linear layers of 16 key and 32
    value heads of 128, a convolution of 4."""
    linear = LinearAttention(16, 32, 128, 128, 4)
    return Case.of_linear(
        gated_deltanet_hybrid("qwen3_5_text", 32, 4096, 16, 4, 248320, 12288, linear)
    )


MODELS: dict[str, Case] = {
    "gpt-oss-20b": gpt_oss_20b(),
    "Gemma-3-27B": gemma3_27b(),
    "Llama-4-Scout": llama4_scout(),
    "Qwen3-Next-80B-A3B": qwen3_next_80b(),
    "Qwen3.5-9B": qwen3_5_9b(),
}


def layer_summary(layout: KVLayout) -> str:
    """The layers by kind and, mixed, the KV groups they form: "12 full, 12 sliding 128; 2
    groups of 12", "10 full, 52 sliding 1024; 7 groups: 6 of 10, 1 of 2"; all full: "24 full"."""
    groups = layout.groups
    counts: dict[str, int] = {}
    for group in groups.groups:  # full attention first
        counts[group.kind.label] = counts.get(group.kind.label, 0) + len(group.layers)
    text = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    if not layout.layer_kinds:
        return f"{layout.num_layers} full"
    sizes: dict[int, int] = {}
    for group in groups.groups:
        sizes[len(group.layers)] = sizes.get(len(group.layers), 0) + 1
    if len(sizes) == 1:
        return f"{text}; {groups.num_groups} groups of {next(iter(sizes))}"
    parts = ", ".join(f"{n} of {size}" for size, n in sizes.items())
    return f"{text}; {groups.num_groups} groups: {parts}"


def page_bytes(layout: KVLayout) -> int:
    """One layer's pages of a block (every plane)."""
    return layout.bytes_per_block // layout.num_slots


# --- the KV managers' side: block ids only ------------------------------------------------------


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


@dataclass(slots=True)
class HandoffPlan:
    """One layout's handoff of a prompt, as the two KV managers hold it."""

    layout: KVLayout
    prefill_blocks: int  # the prefill-side pool: the KV manager's peak_blocks
    prefill_peak: int  # the most blocks the sequence held at once while its chunks ran
    src: list[int]  # the prefill side's blocks the handoff moves, group after group
    dst: list[int]  # the decode side's blocks they land in
    blocks_per_group: list[int]  # of src, by KV group
    cached_blocks: int  # the prefix cache's blocks once the prompt ran, in a pool with room

    @property
    def pool_blocks(self) -> int:
        """Both sides' pools."""
        return self.prefill_blocks + len(self.dst)

    def padding_bytes(self, layout: KVLayout) -> int:
        """Bytes moved (in `layout`, this plan's with its measured heads) in slots no layer of
        their group holds: a group smaller than the pool's slots leaves its blocks' other pages
        unused, and a block moves whole."""
        if not layout.layer_kinds:
            return 0
        slots, page = layout.num_slots, page_bytes(layout)
        groups = layout.groups.groups
        return sum(
            n * (slots - len(g.layers)) * page for n, g in zip(self.blocks_per_group, groups)
        )


def plan_handoff(layout: KVLayout, tokens: int, max_chunk: int, seed: int = 0) -> HandoffPlan:
    """Run a prompt of `tokens` through a prefill-side KV manager as the scheduler does (chunks
    of max_chunk) and reserve its arriving KV on a decode-side one; the two block lists pair
    up. Raises RuntimeError where an allocation fails: the pools are sized by the managers'
    own accounting, so that is a fault of it."""
    groups = layout.groups
    prompt = prompt_ids(tokens, seed)
    bs = layout.block_size
    # The prefill side: the pool peak_blocks says one such sequence needs at most.
    sizing = KVCacheManager(BlockManager(1, bs), groups)
    prefill_blocks = sizing.peak_blocks(tokens, max_chunk)
    kv = KVCacheManager(BlockManager(prefill_blocks, bs), groups)
    seq = Sequence("prefill", prompt, PARAMS, prefill_only=True)
    peak = prefill(kv, seq, max_chunk)
    tables = [list(t) for t in seq.block_tables]  # what the engine hands over (held_tables)
    src = handoff_blocks(tables, 0)
    if len(src) != kv.handoff_size(tokens):
        raise RuntimeError(f"{len(src)} blocks held for the handoff, handoff_size says otherwise")
    # The decode side: a pool of exactly the blocks the handoff moves.
    decode = KVCacheManager(BlockManager(max(1, len(src)), bs), groups)
    arriving = Sequence("decode", prompt, PARAMS)
    arriving.num_computed_tokens = tokens
    if not decode.allocate_arriving(arriving, tokens, 0):
        raise RuntimeError(f"the decode side reserved more than the {len(src)} blocks sent")
    dst = handoff_blocks(arriving.block_tables, 0)
    if len(dst) != len(src):
        raise RuntimeError(f"{len(src)} blocks sent into {len(dst)} reserved")
    per_group = [sum(1 for b in t if b >= 0) for t in tables]
    for group, n in zip(groups.groups, per_group):
        if isinstance(group.kind, LinearState) and n != 1:
            raise RuntimeError(f"a linear group's handoff moves {n} blocks, not its one state")
    # The prefix cache: the same prompt in a pool with room for every block it leaves behind
    # (in peak_blocks' pool, later chunks evict them).
    roomy = KVCacheManager(BlockManager(groups.num_groups * (tokens // bs + 1), bs), groups)
    prefill(roomy, Sequence("cached", prompt, PARAMS, prefill_only=True), max_chunk)
    cached = roomy.block_manager.num_cached_blocks
    return HandoffPlan(layout, prefill_blocks, peak, src, dst, per_group, cached)


def prefill(kv: KVCacheManager, seq: Sequence, max_chunk: int) -> int:
    """Compute seq's prompt as the scheduler drives it, in chunks of at most max_chunk tokens;
    the most blocks the pool had in use at once. Raises RuntimeError where a chunk finds no
    room."""
    seq.num_computed_tokens = seq.num_cached_tokens = kv.allocate_prefix(seq)
    peak = 0
    while seq.num_uncomputed_tokens:
        n = min(max_chunk, seq.num_uncomputed_tokens)
        if not kv.allocate_slots(seq, seq.num_computed_tokens + n, seq.num_computed_tokens):
            raise RuntimeError(
                f"{seq.num_tokens} tokens: a chunk of {n} found no room in the pool's "
                f"{kv.block_manager.num_blocks} blocks"
            )
        peak = max(peak, kv.block_manager.num_used_blocks)
        seq.num_computed_tokens += n
        kv.cache_full_blocks(seq)
        kv.release_unread(seq)
    return peak


def fitting_heads(
    plans: list[HandoffPlan], budget: int, allowed: Callable[[int], bool] = lambda heads: True
) -> int:
    """The most KV heads (the layouts' own, halved until it fits) at which every plan's pools,
    both sides, fit in `budget` bytes together; 0 if not even one head does, or if the halving
    reaches heads that `allowed` refuses (a linear state's heads that do not divide so)."""
    heads = plans[0].layout.num_kv_heads
    while heads >= 1 and allowed(heads):
        need = sum(
            p.pool_blocks * replace(p.layout, num_kv_heads=heads).bytes_per_block for p in plans
        )
        if need <= budget:
            return heads
        heads //= 2
    return 0


def cached_bytes_per_token(layout: KVLayout) -> float:
    """What a prompt left in the prefix cache keeps per token: each KV group a block per
    block_size tokens (a full group its KV; a linear group its state at each block boundary, a
    snapshot a later prompt resumes from; a windowed one its blocks until evicted), each block
    with all the pool's slots."""
    groups = layout.groups.num_groups if layout.layer_kinds else 1
    return groups * layout.bytes_per_block / layout.block_size


def case_summary(case: Case) -> dict:
    """What the results file says of a case beside its figures: block sizes, the bytes per
    cached token both ways and, for a linear hybrid, its state against a page."""
    out = {
        "block_size": {"hybrid": case.hybrid.block_size, "all_full": case.all_full.block_size},
        "cached_bytes_per_token": {
            "hybrid": cached_bytes_per_token(case.hybrid),
            "all_full": cached_bytes_per_token(case.all_full),
        },
    }
    state = case.state_at(case.hybrid.num_kv_heads)
    if state is not None:
        elem = torch.tensor([], dtype=case.hybrid.torch_dtype).element_size()
        linear = case.linear.linear_attention
        out["block_size"]["why"] = (
            f"the hybrid's is fitted_block_size(config, {case.all_full.block_size}): the "
            f"requested size's smallest multiple whose page holds a linear layer's state "
            f"({state.min_block_size()} tokens or more); the all-full model's stays the "
            f"requested {case.all_full.block_size}"
        )
        out["linear_attention"] = {
            "num_k_heads": linear.num_k_heads,
            "num_v_heads": linear.num_v_heads,
            "head_k_dim": linear.head_k_dim,
            "head_v_dim": linear.head_v_dim,
            "conv_kernel": linear.conv_kernel,
        }
        out["linear_state_bytes"] = state.per_head * state.pool_heads * elem  # one layer's
        out["page_bytes"] = page_bytes(case.hybrid)
    return out


# --- the bytes: a real transport between two pools ----------------------------------------------


class HandoffTransfer:
    """One plan's handoff over a transport: the prefill side's pool (random bits) and sender, the
    decode side's receiver and its pool, in this process."""

    def __init__(self, plan: HandoffPlan, layout: KVLayout, transport: str, chunk_bytes: int):
        self.src, self.dst = plan.src, plan.dst
        self.pool = KVPool(layout, plan.prefill_blocks)
        self.pool.kv.view(torch.int16).random_()  # touch every page, arbitrary bits
        self.receiver = make_receiver(transport, layout, len(plan.dst))
        self.sender = make_sender(transport, self.pool, chunk_bytes=chunk_bytes)
        self.sender.connect("decode", self.receiver.info())
        self.count = 0

    def run(self) -> float:
        """One handoff; the seconds from send() to the sender seeing the receiver's ack."""
        self.count += 1
        tid = f"handoff-{self.count}"
        self.receiver.expect(tid, list(self.dst), timeout_s=TIMEOUT_S)
        t0 = time.perf_counter()
        self.sender.send(KVSend(tid, "decode", list(self.src), list(self.dst), timeout_s=TIMEOUT_S))
        sent = wait_for(self.sender, {}, tid, TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        if sent is None or not sent.ok:
            raise RuntimeError(f"{tid}: {sent}")
        landed = wait_for(self.receiver, {}, tid, TIMEOUT_S)
        if landed is None or not landed.ok:
            raise RuntimeError(f"{tid} landed: {landed}")
        return elapsed

    def landed_intact(self) -> bool:
        """Every page moved equals its source, bit for bit (a block at a time: no copy of the
        whole)."""
        src, dst = self.pool.kv, self.receiver.pool.kv
        return all(
            torch.equal(src[:, :, s].view(torch.int16), dst[:, :, d].view(torch.int16))
            for s, d in zip(self.src, self.dst)
        )

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def _side(plan: HandoffPlan, heads: int, tokens: int, times: list[float] | None) -> dict:
    measured = replace(plan.layout, num_kv_heads=heads)
    moved = len(plan.src) * measured.bytes_per_block
    scale = plan.layout.num_kv_heads / heads
    cached_tokens = tokens // plan.layout.block_size * plan.layout.block_size
    out = {
        "layout": plan.layout.to_dict(),
        "layers": layer_summary(plan.layout),
        "block_bytes": plan.layout.bytes_per_block,
        "blocks": len(plan.src),
        "blocks_per_group": plan.blocks_per_group,
        "prefill_pool_blocks": plan.prefill_blocks,  # peak_blocks
        "prefill_peak_blocks": plan.prefill_peak,  # measured
        "bytes": moved,  # at the measured heads
        "padding_bytes": plan.padding_bytes(measured),
        "bytes_per_token": moved / tokens,
        # at the model's own KV heads: bytes are linear in them
        "model_bytes_per_token": moved * scale / tokens,
        # the prefill side's prefix cache once the prompt ran: its whole blocks, every group's
        "cached_blocks": plan.cached_blocks,
        "cached_tokens": cached_tokens,
    }
    if cached_tokens:
        out["model_cached_bytes_per_token"] = (
            plan.cached_blocks * plan.layout.bytes_per_block / cached_tokens
        )
    if times is not None:
        seconds = statistics.median(times)
        out |= {"seconds": seconds, "GB/s": moved / seconds / 1e9, "times_s": times}
    return out


def handoffs(
    models: dict[str, Case],
    tokens_list: list[int] | None,
    max_chunk: int,
    transport: str,
    chunk_bytes: int,
    repeats: int,
    budget: int,
) -> tuple[list[dict], list[str]]:
    """Each model's handoff at each prompt length, hybrid and all-full in the same rounds; and
    what was measured otherwise than asked (fewer heads), in words. tokens_list None: each
    case's own prompt lengths."""
    rows, notes = [], []
    for name, case in models.items():
        layout = case.hybrid
        for tokens in case.tokens if tokens_list is None else tokens_list:
            plans = {
                "hybrid": plan_handoff(layout, tokens, max_chunk),
                "all-full": plan_handoff(case.all_full, tokens, max_chunk),
            }
            heads = fitting_heads(list(plans.values()), budget, case.measurable_at)
            need = sum(p.pool_blocks * p.layout.bytes_per_block for p in plans.values())
            if heads == 0:
                notes.append(
                    f"{name}, {tokens} tokens: not moved: its pools need more than "
                    f"{budget / 2**30:.1f} GiB at the fewest KV heads it may be moved with"
                )
                continue
            if heads < layout.num_kv_heads:
                shrink = layout.num_kv_heads // heads
                state = case.state_at(heads)
                linear = (
                    ""
                    if state is None
                    else (
                        f", its linear layers' heads cut alike to {state.num_k_heads} key and "
                        f"{state.num_v_heads} value heads (a state of 1/{shrink} the size in "
                        f"pages of the same {layout.block_size} tokens)"
                    )
                )
                notes.append(
                    f"{name}, {tokens} tokens: the four pools (both sides, hybrid and all-full) "
                    f"need {need / 2**30:.1f} GiB at {layout.num_kv_heads} KV heads and "
                    f"{budget / 2**30:.1f} GiB were given: moved with {heads} KV heads{linear} "
                    f"(bytes x {shrink} for the model's own)"
                )
            transfers = {}
            try:
                for label, plan in plans.items():
                    measured = replace(plan.layout, num_kv_heads=heads)
                    transfers[label] = HandoffTransfer(plan, measured, transport, chunk_bytes)
                times = measure({label: t.run for label, t in transfers.items()}, repeats)
                for label, t in transfers.items():
                    if not t.landed_intact():
                        raise RuntimeError(f"{name} {label}: pages landed altered")
            finally:
                for t in transfers.values():
                    t.close()
            row = {
                "model": name,
                "tokens": tokens,
                "kv_heads": layout.num_kv_heads,
                "measured_kv_heads": heads,
                "transport": transport,
                "block_sizes": [layout.block_size, case.all_full.block_size],
                "hybrid": _side(plans["hybrid"], heads, tokens, times["hybrid"]),
                "all_full": _side(plans["all-full"], heads, tokens, times["all-full"]),
                # median over rounds of the hybrid handoff's time over the all-full one's
                "time_ratio": per_round(times, "all-full", "hybrid"),
            }
            row["bytes_ratio"] = row["hybrid"]["bytes"] / row["all_full"]["bytes"]
            rows.append(row)
            print(
                f"# {name} {tokens} tokens: {row['hybrid']['bytes'] / 2**20:,.0f} MiB in "
                f"{row['hybrid']['seconds'] * 1e3:,.0f} ms against "
                f"{row['all_full']['bytes'] / 2**20:,.0f} MiB in "
                f"{row['all_full']['seconds'] * 1e3:,.0f} ms ({heads} KV heads)",
                flush=True,
            )
    return rows, notes


# --- capacity: conversations one pool holds -----------------------------------------------------


def conversations_held(
    layout: KVLayout, pool_bytes: int, prompt_tokens: int, decode_tokens: int
) -> dict:
    """Conversations admitted into one pool until an allocation fails: each arrives with its
    prompt's KV (allocate_arriving, as a decode node reserves a handoff) and decodes
    decode_tokens tokens one step at a time, the earlier ones holding their blocks."""
    bs = layout.block_size
    num_blocks = pool_bytes // layout.bytes_per_block
    bm = BlockManager(num_blocks, bs)
    kv = KVCacheManager(bm, layout.groups)
    rng = random.Random(1)
    held, per_conversation = 0, 0
    while True:
        prompt = [rng.randrange(32000) for _ in range(prompt_tokens)]
        seq = Sequence(f"conversation-{held}", prompt + [rng.randrange(32000)], PARAMS)
        seq.num_computed_tokens = prompt_tokens
        before = bm.num_used_blocks
        if not kv.allocate_arriving(seq, prompt_tokens, 0):
            break
        fits = True
        for _ in range(decode_tokens):
            computed = seq.num_computed_tokens
            if not kv.allocate_slots(seq, computed + 1, computed):
                fits = False
                break
            seq.num_computed_tokens += 1
            seq.append_token(rng.randrange(32000))
            kv.cache_full_blocks(seq)
            kv.release_unread(seq)
        if not fits:
            break
        per_conversation = bm.num_used_blocks - before
        held += 1
    total = prompt_tokens + decode_tokens
    peak = kv.peak_blocks(total, 1)
    return {
        "layout": layout.to_dict(),
        "layers": layer_summary(layout),
        "block_bytes": layout.bytes_per_block,
        "pool_blocks": num_blocks,
        "blocks_per_conversation": per_conversation,  # held once decoded, measured
        "conversations": held,  # measured
        "peak_blocks": peak,  # the KV manager's formula for one sequence
        "formula_conversations": num_blocks // peak,
    }


def capacity(
    models: dict[str, Case], pool_bytes: int, prompt_tokens: int, decode_tokens: int
) -> list[dict]:
    rows = []
    for name, case in models.items():
        row = {
            "model": name,
            "pool_bytes": pool_bytes,
            "hybrid": conversations_held(case.hybrid, pool_bytes, prompt_tokens, decode_tokens),
            "all_full": conversations_held(case.all_full, pool_bytes, prompt_tokens, decode_tokens),
        }
        row["ratio"] = row["hybrid"]["conversations"] / max(1, row["all_full"]["conversations"])
        rows.append(row)
        print(
            f"# {name}: {row['hybrid']['conversations']} conversations hybrid, "
            f"{row['all_full']['conversations']} all-full",
            flush=True,
        )
    return rows


# --- the docs' tables (`python -m pdserve.bench.docs` renders them from the results file) -------


LEFT, RIGHT = "---", "---:"  # a column's alignment, as its separator cell


def markdown_table(columns: list[tuple[str, str]], rows: Iterable[list[str]]) -> str:
    """columns: each one's heading and alignment (LEFT, RIGHT); rows: each one's cells."""
    lines = [[heading for heading, _ in columns], [align for _, align in columns], *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def layouts_table(results: dict) -> str:
    """Each model's layers, its KV groups, and a block's bytes both ways."""
    columns = [
        ("model", LEFT),
        ("layers (hybrid: KV groups)", LEFT),
        ("KV heads × dim", LEFT),
        ("block, hybrid", RIGHT),
        ("block, all-full", RIGHT),
    ]
    rows = []
    for row in results["capacity"]:
        h, f = row["hybrid"], row["all_full"]
        lay = h["layout"]
        slots_h = h["block_bytes"] // page_bytes(KVLayout.from_dict(lay))
        rows.append(
            [
                row["model"],
                h["layers"],
                f"{lay['num_kv_heads']} × {lay['head_dim']}",
                f"{h['block_bytes'] / 2**20:.2f} MiB "
                f"({slots_h} slots × {lay['block_size']} tokens)",
                f"{f['block_bytes'] / 2**20:.2f} MiB "
                f"({lay['num_layers']} slots × {f['layout']['block_size']} tokens)",
            ]
        )
    return markdown_table(columns, rows)


def handoff_table(results: dict) -> str:
    """Bytes per prompt token (the model's own KV heads) and the handoff's time, both ways."""
    columns = [("model", LEFT)] + [
        (heading, RIGHT)
        for heading in (
            "prompt tokens",
            "KV heads moved",
            "hybrid bytes / token",
            "all-full bytes / token",
            "hybrid / all-full bytes",
            "hybrid MiB",
            "hybrid ms",
            "all-full MiB",
            "all-full ms",
            "hybrid / all-full time",
        )
    ]
    rows = []
    for row in results["handoffs"]:
        h, f = row["hybrid"], row["all_full"]
        heads = str(row["measured_kv_heads"])
        if row["measured_kv_heads"] != row["kv_heads"]:
            heads += f" of {row['kv_heads']}"
        rows.append(
            [
                row["model"],
                f"{row['tokens']:,}",
                heads,
                f"{h['model_bytes_per_token']:,.0f}",
                f"{f['model_bytes_per_token']:,.0f}",
                f"{row['bytes_ratio']:.3f}",
                f"{h['bytes'] / 2**20:,.1f}",
                f"{h['seconds'] * 1e3:,.0f}",
                f"{f['bytes'] / 2**20:,.0f}",
                f"{f['seconds'] * 1e3:,.0f}",
                f"{row['time_ratio']:.3f}",
            ]
        )
    return markdown_table(columns, rows)


def snapshot_table(results: dict) -> str:
    """What a cached prompt keeps per token in the prefix cache, both ways, from the layouts
    (each group a block per block_size tokens), beside the count the prefill side's cache held
    after the longest prompt measured; for linear hybrids, a layer's state against its page."""
    columns = [("model", LEFT)] + [
        (heading, RIGHT)
        for heading in (
            "block tokens, hybrid / all-full",
            "linear state / page",
            "hybrid bytes / cached token",
            "all-full bytes / cached token",
            "hybrid / all-full",
            "measured after a prompt of",
            "cached blocks, hybrid / all-full",
            "hybrid / all-full, measured",
        )
    ]
    longest: dict[str, dict] = {}
    for row in results["handoffs"]:
        if row["tokens"] >= longest.get(row["model"], {"tokens": 0})["tokens"]:
            longest[row["model"]] = row
    rows = []
    for name, case in results["cases"].items():
        sizes, cached = case["block_size"], case["cached_bytes_per_token"]
        state = "-"
        if "linear_state_bytes" in case:
            state = (
                f"{case['linear_state_bytes'] / 2**20:.2f} / {case['page_bytes'] / 2**20:.2f} MiB"
            )
        cells = [
            name,
            f"{sizes['hybrid']} / {sizes['all_full']}",
            state,
            f"{cached['hybrid']:,.0f}",
            f"{cached['all_full']:,.0f}",
            f"{cached['hybrid'] / cached['all_full']:.3f}",
        ]
        row = longest.get(name)
        if row is None:
            cells += ["-", "-", "-"]
        else:
            h, f = row["hybrid"], row["all_full"]
            cells += [
                f"{row['tokens']:,}",
                f"{h['cached_blocks']:,} / {f['cached_blocks']:,}",
                f"{h['model_cached_bytes_per_token'] / f['model_cached_bytes_per_token']:.3f}",
            ]
        rows.append(cells)
    return markdown_table(columns, rows)


def capacity_table(results: dict) -> str:
    """Conversations one pool holds, measured, beside the count peak_blocks gives."""
    columns = [("model", LEFT)] + [
        (heading, RIGHT)
        for heading in (
            "pool GiB",
            "hybrid blocks / conversation",
            "hybrid conversations (peak_blocks)",
            "all-full blocks / conversation",
            "all-full conversations (peak_blocks)",
            "hybrid / all-full",
        )
    ]
    rows = []
    for row in results["capacity"]:
        h, f = row["hybrid"], row["all_full"]
        rows.append(
            [
                row["model"],
                f"{row['pool_bytes'] / 2**30:g}",
                f"{h['blocks_per_conversation']:,}",
                f"{h['conversations']:,} ({h['formula_conversations']:,})",
                f"{f['blocks_per_conversation']:,}",
                f"{f['conversations']:,} ({f['formula_conversations']:,})",
                f"{row['ratio']:.2f}x",
            ]
        )
    return markdown_table(columns, rows)


def notes_list(results: dict) -> str:
    """What the run measured otherwise than asked, one line each (none: says so)."""
    notes = results.get("notes") or []
    if not notes:
        return "Every case was moved at the model's own KV heads."
    return "\n".join(f"- {note}" for note in notes)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=None,
        help="prompt lengths (default: each model's: 8192 and 32768; linear hybrids 2048 too)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="a prefill chunk")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    ap.add_argument("--chunk-mib", type=float, default=8.0, help="the sender's chunk size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--memory-gib",
        type=float,
        default=6.0,
        help="the most a case's four pools take (less if the host has less available)",
    )
    ap.add_argument("--pool-gib", type=float, default=64.0, help="capacity: one pool's size")
    ap.add_argument("--conversation-tokens", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--out", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    record = provenance.start([__file__, *argv])
    record["machine"]["zmq"] = f"{zmq.pyzmq_version()} / libzmq {zmq.zmq_version()}"
    print(f"# {record['command']}", flush=True)
    models = {name: MODELS[name] for name in args.models}
    budget = min(int(args.memory_gib * 2**30), available_bytes())
    pool_bytes = int(args.pool_gib * 2**30)
    results = run(
        models,
        args.tokens,
        args.max_num_batched_tokens,
        args.transport,
        int(args.chunk_mib * 2**20),
        args.repeats,
        budget,
        pool_bytes,
        args.conversation_tokens,
        args.decode_tokens,
    )
    results["settings"] |= {"memory_gib": args.memory_gib, "chunk_mib": args.chunk_mib}
    out = provenance.finish(record) | {"note": SHARED} | results
    tables = (layouts_table, handoff_table, snapshot_table, capacity_table, notes_list)
    print(*(table(out) for table in tables), sep="\n\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def run(
    models: dict[str, Case],
    tokens: list[int] | None,
    max_chunk: int,
    transport: str,
    chunk_bytes: int,
    repeats: int,
    budget: int,
    pool_bytes: int,
    conversation_tokens: int,
    decode_tokens: int,
) -> dict:
    """Both measurements: the results file's body (settings, each case's block sizes and bytes
    per cached token, handoffs, capacity, notes)."""
    rows, notes = handoffs(models, tokens, max_chunk, transport, chunk_bytes, repeats, budget)
    return {
        "settings": {
            "models": list(models),
            "tokens": tokens or {name: list(case.tokens) for name, case in models.items()},
            "max_num_batched_tokens": max_chunk,
            "transport": transport,
            "repeats": repeats,
            "memory_budget_gib": budget / 2**30,
            "pool_gib": pool_bytes / 2**30,
            "conversation_tokens": conversation_tokens,
            "decode_tokens": decode_tokens,
        },
        "cases": {name: case_summary(case) for name, case in models.items()},
        "handoffs": rows,
        "capacity": capacity(models, pool_bytes, conversation_tokens, decode_tokens),
        "notes": notes,
    }


if __name__ == "__main__":
    main()
