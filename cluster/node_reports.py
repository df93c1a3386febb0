"""What a node tells the coordinator about its engine: its registration, its load, and a sampled
token's logprobs, as the wire messages that carry them. Torch-free: the engine is read through
the attributes every node engine has (the real one, and the tuner's simulated one)."""

from __future__ import annotations

import os
from typing import Any

from pdserve.cluster.node_messages import (
    Heartbeat,
    KVTierReport,
    NodeRole,
    Register,
    TokenLogprobs,
)


def wire_logprobs(logprobs: list[dict]) -> TokenLogprobs | None:
    """The engine's logprobs of a sampled token, as they travel."""
    if not logprobs:
        return None
    lp = logprobs[0]
    token_id, logprob = lp["token"]
    return TokenLogprobs(token_id, logprob, [(t, v) for t, v in lp["top"]])


def engine_registration(
    engine: Any, node_id: str, role: NodeRole, transport: str, receiver_info: dict
) -> Register:
    return Register(
        node_id=node_id,
        role=role,
        model=engine.model_name,
        block_size=engine.layout.block_size,
        num_blocks=engine.block_manager.num_blocks,
        max_model_len=engine.max_model_len,
        transport=transport,
        kv_layout=engine.layout.to_dict(),
        receiver_info=receiver_info,
        pid=os.getpid(),
    )


def engine_heartbeat(
    engine: Any, node_id: str, pending_transfers: int, kv_error: str | None = None
) -> Heartbeat:
    load = engine.load()
    return Heartbeat(
        node_id=node_id,
        free_blocks=load.free_blocks,
        total_blocks=load.total_blocks,
        running=load.running,
        waiting=load.waiting,
        queued_prefill_tokens=load.queued_prefill_tokens,
        prefix_hits=load.prefix_hits,
        prefix_misses=load.prefix_misses,
        forced_tokens=load.forced_tokens,
        spec_draft_tokens=load.spec_draft_tokens,
        spec_accepted_tokens=load.spec_accepted_tokens,
        spec_accepted_per_position=load.spec_accepted_per_position,
        spec_draft_catch_up_tokens=load.spec_draft_catch_up_tokens,
        spec_draft_cached_tokens=load.spec_draft_cached_tokens,
        pending_transfers=pending_transfers,
        kv_error=kv_error,
        kv_tiers=tier_report(load.kv_tiers, load.kv_tier_blocks),
        prefill_tokens_computed=load.prefill_tokens_computed,
    )


def tier_report(stats: Any, blocks: dict[str, int]) -> KVTierReport | None:
    """A node's KV tier counters (`pdserve.engine.kv.tiers.TierStats`) as they travel."""
    if stats is None:
        return None
    return KVTierReport(
        hit_blocks=dict(stats.hit_blocks),
        miss_blocks=dict(stats.miss_blocks),
        written_bytes=dict(stats.written_bytes),
        loaded_bytes=dict(stats.loaded_bytes),
        loads=stats.loads,
        load_seconds=stats.load_seconds,
        failures=stats.failures,
        blocks=dict(blocks),
    )
