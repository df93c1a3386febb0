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
    ids = block_tables[:, :num_blocks_needed].clamp(min=0).reshape(-1)
    gathered = cache.index_select(0, ids)  # [B * nb, block_size, H, D]
    return gathered.view(batch, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_len]


# Decode attention gathers each group of sequences' K/V into a buffer this size at most, so the
# buffer stays in cache while attention reads it: the pool is then read from memory once.
DECODE_GROUP_BYTES = 4 << 20


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """One query per sequence attending to all seq_lens[b] cached tokens.

    query: [B, num_heads, head_dim]. Sequences go in groups of similar length, each padded only
    to its own longest, so little is gathered beyond the real context.
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    order = sorted(range(batch), key=seq_lens.__getitem__)
    token_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, batch):
        padded = -(-seq_lens[order[i]] // block_size) * block_size
        if (i - start + 1) * padded * token_bytes > DECODE_GROUP_BYTES:
            groups.append((start, i))
            start = i
    groups.append((start, batch))
    index = torch.tensor(order, device=query.device)
    tables = block_tables.index_select(0, index).clamp_(min=0)  # padding may be -1
    lens = torch.tensor([seq_lens[b] for b in order], device=query.device)
    q = query.index_select(0, index).unsqueeze(2).to(k_cache.dtype)  # [B, H, 1, D]
    outs = []
    for start, end in groups:
        n = end - start
        num_blocks = -(-seq_lens[order[end - 1]] // block_size)
        ids = tables[start:end, :num_blocks].reshape(-1)
        width = num_blocks * block_size
        keys = k_cache.index_select(0, ids).view(n, width, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, ids).view(n, width, num_kv_heads, head_dim).transpose(1, 2)
        mask = torch.arange(width, device=query.device)[None, :] < lens[start:end, None]
        outs.append(
            F.scaled_dot_product_attention(
                q[start:end],
                keys,
                values,
                attn_mask=mask[:, None, None, :],
                scale=scale,
                enable_gqa=gqa,
            )
        )
    out = torch.empty_like(query)
    out.index_copy_(0, index, torch.cat(outs).squeeze(2).to(query.dtype))
    return out


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
    if num_tokens == 0:
        return torch.empty_like(query)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    lens = seq_lens.tolist()
    if max_query_len == 1 and num_tokens == batch:
        # Decode-only batch: one query per sequence.
        return _decode_attention(query, k_cache, v_cache, block_tables, lens, scale)
    out = torch.empty_like(query)
    gqa = num_heads != num_kv_heads
    starts = query_start_loc.tolist()
    # Single-query rows (decodes in a step that also prefills) go through the batched path.
    single = [b for b in range(batch) if starts[b + 1] - starts[b] == 1]
    if single:
        rows = torch.tensor(single, device=query.device)
        tokens = torch.tensor([starts[b] for b in single], device=query.device)
        out.index_copy_(
            0,
            tokens,
            _decode_attention(
                query.index_select(0, tokens),
                k_cache,
                v_cache,
                block_tables.index_select(0, rows),
                [lens[b] for b in single],
                scale,
            ),
        )
    for b in range(batch):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len <= 1:
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
