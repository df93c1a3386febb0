"""Attention for a long run of one sequence's query tokens on CPU (a prefill chunk): its K/V
gathered from its pages into one contiguous tensor, then torch's scaled_dot_product_attention,
whose CPU flash-attention kernel works through the queries and keys in blocks. The C kernel
(paged_attention_cpu) reads every key once per query token, which for a prompt of n tokens is
n²/2 reads of each key: right for decodes, several times slower than blocks for a long prompt.
Same semantics as `attention_ref.paged_attention` for the rows it is given."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
) -> torch.Tensor:
    """query (q_len, heads, head_dim): the last q_len tokens of a sequence of seq_len tokens
    whose K/V (its queries' own included) are in the pool's pages listed by block_table;
    each query attends every key up to its own position. Returns (q_len, heads, head_dim)."""
    q_len, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    blocks = block_table[: -(-seq_len // block_size)].to(torch.int64)
    k = k_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:seq_len]
    v = v_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:seq_len]
    context = seq_len - q_len
    if context == 0:
        mask, causal = None, True
    else:  # query i sees keys 0 .. context + i: the causal diagonal shifted by the context
        rows = torch.arange(q_len).unsqueeze(1) + context
        mask, causal = torch.arange(seq_len).unsqueeze(0) <= rows, False
    # (1, heads, tokens, head_dim): with a batch dimension SDPA takes its flash kernel on CPU
    # (without one, the math path, several times slower); grouped-query heads as they are.
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=kv_heads != heads,
    )[0]
    return out.transpose(0, 1)
