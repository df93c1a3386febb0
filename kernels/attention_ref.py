"""Torch reference for paged attention and KV-slot writes.

These define the semantics every GPU kernel must match, and they are the CPU path of the engine.
A layer may see only part of the context: a sliding window, a local chunk (both per layer), and
it may have attention sinks; `first_visible_keys` is the one rule every backend implements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def first_visible_keys(positions: torch.Tensor, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """The first key each query position sees; it sees every key from there to itself.

    window W: keys k with position - W < k (transformers' `sliding_window_overlay`); chunk C:
    keys in the query's own chunk, k // C == position // C (its `chunked_overlay`); 0: off."""
    first = torch.zeros_like(positions)
    if window:
        first = torch.maximum(first, positions - window + 1)
    if chunk:
        first = torch.maximum(first, positions - positions % chunk)
    return first


def check_visibility(window: int, chunk: int, sinks: torch.Tensor | None, num_heads: int) -> None:
    """Refuse a negative window or chunk, or sinks that are not one logit per query head."""
    if window < 0 or chunk < 0:
        raise ValueError(f"window ({window}) and chunk ({chunk}) must be >= 0 (0: off)")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: want one per head ({num_heads})")


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


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, H, Q, D] over keys, values [B, H_kv, K, D] where the boolean mask (broadcast to
    [B, H, Q, K]) holds."""
    gqa = q.shape[1] != keys.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    # gpt-oss's eager attention: each head's sink is one more logit in its softmax, with no value.
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).float()
    values = values.repeat_interleave(group, dim=1).float()
    scores = (q.float() @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ values).to(q.dtype)


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
    window: int,
    chunk: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query per sequence attending to the cached tokens it sees of its seq_lens[b].

    query: [B, num_heads, head_dim]. Each sequence's pages are read from the first one holding a
    key it sees (blocks before it may be freed: -1). Sequences go in groups of similar span, each
    padded only to its own longest, so little is gathered beyond the keys they see.
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = query.device
    lens = torch.tensor(seq_lens, device=device)
    firsts = first_visible_keys(lens - 1, window, chunk)
    skipped = firsts // block_size  # leading blocks of each table that no query reads
    spans = (lens - skipped * block_size).tolist()
    order = sorted(range(batch), key=spans.__getitem__)
    token_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, batch):
        padded = -(-spans[order[i]] // block_size) * block_size
        if (i - start + 1) * padded * token_bytes > DECODE_GROUP_BYTES:
            groups.append((start, i))
            start = i
    groups.append((start, batch))
    index = torch.tensor(order, device=device)
    width = block_tables.shape[1]
    columns = skipped.index_select(0, index)[:, None] + torch.arange(width, device=device)
    tables = block_tables.index_select(0, index).gather(1, columns.clamp_(max=width - 1))
    tables = tables.clamp_(min=0)  # padding may be -1
    offsets = skipped.index_select(0, index) * block_size  # the position of each row's column 0
    lo = firsts.index_select(0, index) - offsets
    hi = lens.index_select(0, index) - offsets
    q = query.index_select(0, index).unsqueeze(2).to(k_cache.dtype)  # [B, H, 1, D]
    outs = []
    for start, end in groups:
        n = end - start
        num_blocks = -(-spans[order[end - 1]] // block_size)
        ids = tables[start:end, :num_blocks].reshape(-1)
        width = num_blocks * block_size
        keys = k_cache.index_select(0, ids).view(n, width, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, ids).view(n, width, num_kv_heads, head_dim).transpose(1, 2)
        column = torch.arange(width, device=device)[None, :]
        mask = (column >= lo[start:end, None]) & (column < hi[start:end, None])
        outs.append(_attend(q[start:end], keys, values, mask[:, None, None, :], scale, sinks))
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
    *,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened varlen batch of queries over paged KV.

    query: [num_tokens, num_heads, head_dim], grouped per sequence by query_start_loc [B + 1].
    Sequence b has seq_lens[b] tokens of context in the cache (its new tokens included, already
    written), and its q_len = query_start_loc[b + 1] - query_start_loc[b] queries are its last
    q_len positions: the query at position p attends to keys first_visible_keys(p) .. p (0 .. p
    without a window or chunk). Blocks wholly before every query's first key are never read
    (a KV manager may have freed them: -1). sinks [num_heads]: a logit per head that joins the
    softmax's denominator and has no value (gpt-oss).
    Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    batch = seq_lens.shape[0]
    check_visibility(window, chunk, sinks, num_heads)
    if num_tokens == 0:
        return torch.empty_like(query)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    lens = seq_lens.tolist()
    local = (window, chunk, sinks)
    if max_query_len == 1 and num_tokens == batch:
        # Decode-only batch: one query per sequence.
        return _decode_attention(query, k_cache, v_cache, block_tables, lens, scale, *local)
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
                *local,
            ),
        )
    for b in range(batch):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len <= 1:
            continue
        ctx = lens[b]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        firsts = first_visible_keys(q_pos, window, chunk)
        skipped = int(firsts[0]) // block_size  # the first query sees the fewest keys
        table = block_tables[b : b + 1, skipped:]
        keys = _gather_context(k_cache, table, ctx - skipped * block_size).transpose(1, 2)
        values = _gather_context(v_cache, table, ctx - skipped * block_size).transpose(1, 2)
        q = query[q_start:q_end].unsqueeze(0).transpose(1, 2).to(keys.dtype)
        if q_len == ctx and not (window or chunk) and sinks is None:
            o = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            k_pos = torch.arange(skipped * block_size, ctx, device=query.device)
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= firsts[:, None])
            o = _attend(q, keys, values, mask, scale, sinks)
        out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)
    return out
