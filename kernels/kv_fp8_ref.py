"""Torch reference of the FP8 KV cache (`--kv-cache-dtype fp8`): how a token's K or V row of one
KV head is stored in a page, written at store time and read back for attention.

A page of an FP8 pool is bytes (uint8), and each (token, KV head) row of head_dim values is
head_dim float8_e4m3fn bytes followed by its float32 scale (4 bytes): amax / 448 of that row
(1.0 where the row is all zeros). The scale is per token, so a token's bytes depend on that
token alone: a chunked, preempted, prefix-cached or moved sequence has the same pages as one
that was not. The scale sits inside the row, so every byte copy of a page (transfers cut by
heads, tiers, digests) carries it. Attention reads the blocks a batch's tables name,
dequantized into the query's dtype, through the backend's own kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from pdserve.kernels import attention_ref, mla_ref
from pdserve.kernels.op_table import Ops, PagedAttention

FP8_KV_DTYPE = "fp8_e4m3"  # a KV layout's dtype: float8_e4m3fn values with their scales
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
SCALE_BYTES = 4  # one float32 scale per (token, KV head) row


def row_width(head_dim: int) -> int:
    """Bytes one (token, KV head) row takes in an FP8 page."""
    return head_dim + SCALE_BYTES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> its FP8 rows [..., head_dim + 4] uint8: each row's
    values over its own scale, rounded to float8_e4m3fn, then the scale's bytes."""
    values = x.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    fp8 = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([fp8.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows [..., head_dim + 4] uint8 -> their values [..., head_dim] in `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :head_dim].view(torch.float8_e4m3fn).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`attention_ref.store_kv` into FP8 pages [num_blocks, block_size, kv_heads, head_dim + 4]:
    the tokens' rows quantized, then written as bytes."""
    attention_ref.store_kv(quantize_rows(key), quantize_rows(value), k_cache, v_cache, slot_mapping)


def read_blocks(block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct blocks a batch's tables name (ascending), and the tables renumbered into
    that list (-1 entries stay -1): attention then reads a compact copy of just those blocks."""
    valid = block_tables >= 0
    ids = torch.unique(block_tables[valid])
    if ids.numel() == 0:
        ids = torch.zeros(1, dtype=block_tables.dtype, device=block_tables.device)
    renumbered = torch.searchsorted(ids, block_tables.clamp(min=0).contiguous())
    tables = torch.where(valid, renumbered.to(block_tables.dtype), block_tables)
    return ids.to(torch.int64), tables


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`mla_ref.store_latent` into FP8 pages [num_blocks, block_size, 1, L + R + 4]: one scale
    per token for its whole latent row, the rotary part with it (FP8 is a float: a part up to
    2^6 below the row's largest value keeps its 3 mantissa bits)."""
    mla_ref.store_latent(quantize_rows(latent), cache, slot_mapping)


def dequantizing(attention: PagedAttention) -> PagedAttention:
    """`attention` over FP8 pages: the blocks the tables name, dequantized into the query's
    dtype, then `attention` itself over them."""

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
        ids, tables = read_blocks(block_tables)
        keys = dequantize_rows(k_cache.index_select(0, ids), query.dtype)
        values = dequantize_rows(v_cache.index_select(0, ids), query.dtype)
        return attention(
            query,
            keys,
            values,
            tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            window=window,
            chunk=chunk,
            sinks=sinks,
        )

    return paged_attention


def dequantizing_latent(latent_attention: Callable) -> Callable:
    """MLA's `latent_attention` over FP8 latent pages: the blocks the tables name, dequantized
    into the query's dtype, then `latent_attention` itself over them."""

    def attend(
        query: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        max_query_len: int | None,
        value_dim: int,
    ) -> torch.Tensor:
        ids, tables = read_blocks(block_tables)
        latents = dequantize_rows(cache.index_select(0, ids), query.dtype)
        return latent_attention(
            query, latents, tables, seq_lens, query_start_loc, scale, max_query_len, value_dim
        )

    return attend


def fp8_cache_ops(ops: Ops) -> Ops:
    """A backend's ops over an FP8 pool: K/V quantized by the torch path at store time (on
    every backend, the Triton one too), attention by the backend's kernel over dequantized
    blocks; MLA's latent attention likewise. Its name differs, so CUDA graphs (which need
    host-sync-free kernels) stay off."""
    return replace(
        ops,
        name=f"{ops.name}+fp8",
        store_kv=store_kv,
        paged_attention=dequantizing(ops.paged_attention),
        store_latent=store_latent,
        latent_attention=dequantizing_latent(ops.latent_attention),
    )
