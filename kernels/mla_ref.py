"""Torch reference for multi-head latent attention (DeepSeek's MLA) over a latent paged cache.

Each cached token holds one "head" of width L + R: the normalised latent c_kv (L =
kv_lora_rank) beside the rotated shared key k_pe (R = qk_rope_head_dim). Head h's key and value
are decompressed from the latent by kv_b_proj: k_nope_h = W_UK[h] c_kv, v_h = W_UV[h] c_kv.

The absorbed form (what a decode step runs) never decompresses: the query's no-rotary part is
folded into latent space once per query, q_lat_h = W_UK[h]^T q_nope_h, so that

    score_h(t) = q_nope_h . k_nope_h(t) + q_pe_h . k_pe(t) = [q_lat_h, q_pe_h] . latent(t)

and attention becomes multi-query attention with a single KV head, the latent, whose first L
numbers are also the value: out_lat_h = sum_t p_h(t) c_kv(t), and v-space output
W_UV[h] out_lat_h. `latent_attention` is that MQA; `decompressed_attention` is the per-head form
it must equal, the ground truth of the tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels import attention_ref


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' latents [num_tokens, 1, L + R] into their slots of one layer's cache
    [num_blocks, block_size, 1, L + R]; slot -1: skip."""
    flat = cache.view(-1, *cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat.index_copy_(0, slot_mapping, latent.to(cache.dtype))
    else:
        flat.index_copy_(0, slot_mapping[valid], latent[valid].to(cache.dtype))


def latent_attention_via(paged_attention: Callable) -> Callable:
    """The absorbed latent attention computed by a backend's paged attention: MQA whose keys
    and values are both the latent pages. Its output's last R numbers per head (the
    probability-weighted k_pe) are dropped."""

    def latent_attention(
        query: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        max_query_len: int | None,
        value_dim: int,
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, L + R] ([q_lat, q_pe]); cache [num_blocks, block_size,
        1, L + R]; the rest as `attention_ref.paged_attention`. Returns [num_tokens, num_heads,
        value_dim = L]: each head's attention-weighted latent."""
        out = paged_attention(
            query, cache, cache, block_tables, seq_lens, query_start_loc, scale, max_query_len
        )
        return out[..., :value_dim]

    return latent_attention


latent_attention = latent_attention_via(attention_ref.paged_attention)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, N], w_uk [H, N, L] -> q_lat [T, H, L]."""
    return torch.einsum("thn,hnl->thl", q_nope, w_uk)


def expand_output(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out_lat [T, H, L], w_uv [H, V, L] -> [T, H, V]."""
    return torch.einsum("thl,hvl->thv", out_lat, w_uv)


def decompressed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The per-head form: each sequence's cached latents decompressed into every head's keys
    [k_nope_h, k_pe] and values v_h, then causal attention as any model's.

    q_nope [T, H, N], q_pe [T, H, R]; w_uk [H, N, L], w_uv [H, V, L]. Returns [T, H, V]."""
    num_heads, lora = w_uk.shape[0], w_uk.shape[2]
    block_size = cache.shape[1]
    out = q_nope.new_empty(q_nope.shape[0], num_heads, w_uv.shape[1])
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, ctx in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        blocks = block_tables[b, : -(-ctx // block_size)].long()
        latent = cache.index_select(0, blocks).reshape(-1, cache.shape[-1])[:ctx]
        c_kv, k_pe = latent[:, :lora], latent[:, lora:]
        k_nope = torch.einsum("hnl,cl->hcn", w_uk, c_kv)
        keys = torch.cat([k_nope, k_pe[None].expand(num_heads, -1, -1)], dim=-1)
        values = torch.einsum("hvl,cl->hcv", w_uv, c_kv)
        q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], dim=-1).transpose(0, 1)  # [H, q, N + R]
        scores = torch.einsum("hqd,hcd->hqc", q.float(), keys.float()) * scale
        q_pos = torch.arange(ctx - (q1 - q0), ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqc,hcv->qhv", probs, values.float()).to(out.dtype)
    return out
