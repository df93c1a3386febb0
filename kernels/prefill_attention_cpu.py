"""Attention for a long run of one sequence's query tokens on CPU (a prefill chunk): its K/V
gathered from its pages into one contiguous tensor, then torch's scaled_dot_product_attention,
whose CPU flash-attention kernel works through the queries and keys in blocks. The C kernel
(paged_attention_cpu) reads every key once per query token, which for a prompt of n tokens is
n²/2 reads of each key: right for decodes, several times slower than blocks for a long prompt.
Same semantics as `attention_ref.paged_attention` for the rows it is given."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.attention_ref import first_visible_keys

# A sequence with at least this many query tokens in the batch goes through SDPA; below it, the
# C kernel (decodes, short chunks), whose per-token cost over a short context is lower than a
# gather and a call.
MIN_QUERY_TOKENS = 64


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    *,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query (q_len, heads, head_dim): the last q_len tokens of a sequence of seq_len tokens
    whose K/V (its queries' own included) are in the pool's pages listed by block_table;
    each query attends the keys from its first visible one (`first_visible_keys`) up to its own
    position. Returns (q_len, heads, head_dim).

    Under a window or chunk the queries go in slices, each over only the keys its queries see
    (a prompt of n tokens costs n x window, not n²/2; pages before a slice's first key are not
    read, so freed ones (-1) may stand there)."""
    q_len = query.shape[0]
    reach = min(n for n in (window, chunk) if n) if window or chunk else q_len
    step = max(reach, MIN_QUERY_TOKENS)
    positions = torch.arange(seq_len - q_len, seq_len)
    firsts = first_visible_keys(positions, window, chunk)
    out = torch.empty_like(query)
    for a in range(0, q_len, step):
        b = min(a + step, q_len)
        out[a:b] = _slice_attention(
            query[a:b], k_cache, v_cache, block_table, positions[a:b], firsts[a:b], scale, sinks
        )
    return out


def _slice_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    firsts: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Queries at consecutive `positions` over the keys firsts[i] .. positions[i] of each."""
    heads, head_dim = query.shape[1:]
    _, block_size, kv_heads, _ = k_cache.shape
    end = int(positions[-1]) + 1
    skipped = int(firsts[0]) // block_size  # pages wholly before the slice's first key
    start = skipped * block_size
    blocks = block_table[skipped : -(-end // block_size)].to(torch.int64)
    k = k_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[: end - start]
    v = v_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[: end - start]
    keys = torch.arange(start, end)
    if start == 0 and int(firsts[-1]) == 0 and len(positions) == end:
        mask, causal = None, True  # a whole prompt's first slice: the plain causal triangle
    else:
        mask = (keys[None, :] <= positions[:, None]) & (keys[None, :] >= firsts[:, None])
        causal = False
    # (1, heads, tokens, head_dim): with a batch dimension SDPA takes its flash kernel on CPU
    # (without one, the math path, several times slower); grouped-query heads as they are.
    q, k, v = query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if sinks is not None:
        if causal:
            mask, causal = torch.ones(len(keys), len(keys), dtype=torch.bool).tril_(), False
        q, k, v, mask = _with_sink_keys(q, k, v, mask, sinks, scale)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[0] != heads,
    )[0]
    return out.transpose(0, 1)


def _with_sink_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as SDPA arguments: each head gets one more key, seen by every query,
    whose score is the head's sink and whose value is zero. Queries gain a dimension of 1 and
    keys one of 0, the sink key sink / scale there; keys and values are per query head.

    q (heads, n, d), k and v (kv_heads, m, d), mask (n, m)."""
    heads, n, d = q.shape
    m = k.shape[1]
    group = heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    sink_key = torch.zeros(heads, 1, d + 1, dtype=k.dtype)
    sink_key[:, 0, d] = sinks.to(k.dtype) / scale
    q = torch.cat([q, q.new_ones(heads, n, 1)], dim=-1)
    k = torch.cat([torch.cat([k, k.new_zeros(heads, m, 1)], dim=-1), sink_key], dim=1)
    v = torch.cat([v, v.new_zeros(heads, 1, d)], dim=1)
    mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
    return q, k, v, mask
