"""Torch reference for paged attention and KV-slot writes.

These define the semantics every GPU kernel must match, and they are the CPU path of the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V into their slots.

    key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; slot_mapping: [num_tokens] int64, slot = block * block_size + offset, -1 = skip.
    """
    num_blocks, block_size = k_cache.shape[:2]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
    else:
        slots = slot_mapping[valid]
        k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
        v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_len, num_kv_heads, head_dim] of cached tokens."""
    batch = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks_needed = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks_needed].clamp(min=0).long()
    gathered = cache[tables]  # [B, nb, block_size, H, D]
    return gathered.reshape(batch, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_len]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened varlen batch of queries over paged KV.

    query: [num_tokens, num_heads, head_dim], grouped per sequence by query_start_loc [B + 1].
    Sequence b has seq_lens[b] tokens of context in the cache (its new tokens included, already
    written), and its q_len = query_start_loc[b + 1] - query_start_loc[b] queries are its last
    q_len positions: query j attends to keys 0 .. seq_len - q_len + j.
    Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    batch = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    gqa = num_heads != num_kv_heads
    if max_query_len == 1:
        # Decode-only batch: one query per sequence, attended in one padded batched call.
        max_len = int(seq_lens.max())
        keys = _gather_context(k_cache, block_tables, max_len).transpose(1, 2)
        values = _gather_context(v_cache, block_tables, max_len).transpose(1, 2)
        positions = torch.arange(max_len, device=query.device)
        mask = positions[None, :] < seq_lens[:, None].to(query.device)  # [B, max_len]
        q = query.view(batch, 1, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.to(keys.dtype),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
        )
        return o.transpose(1, 2).reshape(num_tokens, num_heads, head_dim).to(query.dtype)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(batch):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        ctx = lens[b]
        keys = _gather_context(k_cache, block_tables[b : b + 1], ctx).transpose(1, 2)
        values = _gather_context(v_cache, block_tables[b : b + 1], ctx).transpose(1, 2)
        q = query[q_start:q_end].unsqueeze(0).transpose(1, 2)
        if q_len == ctx:
            o = F.scaled_dot_product_attention(
                q.to(keys.dtype), keys, values, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
            k_pos = torch.arange(ctx, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q.to(keys.dtype), keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)
    return out
