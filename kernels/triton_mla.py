"""Triton kernels for DeepSeek's multi-head latent attention over the latent paged cache, matching
`mla_ref`: the latent's store, and the absorbed attention (MQA whose single KV head is the latent).

Every kernel splits a cached token's latent into its c_kv part (L numbers, masked up to a power of
two) and its k_pe part (R numbers, likewise), so widths such as 512 + 64 pad to 512 + 64, not
1024. A key tile is read once: the score is q_lat . c_kv + q_pe . k_pe, and the same c_kv tile is
the value. The heads of a block share that tile as the M dimension of tl.dot.

- Decode (one query per sequence): split-K over the context, program (sequence, head block,
  split); a reduce kernel combines the splits when there are several. With at most `block_h`
  heads (16 per rank for DeepSeek-V3 at tensor parallel 8) each cached latent is read once per
  sequence. The split plan uses host-known shapes only (the block-table width), so CUDA graphs
  replay it for any context lengths.
- Prefill, extend and mixed batches: a varlen causal kernel of its own (rows of a tile are
  (query, head) pairs of one sequence), not `triton_attention.paged_attention` over the latent as
  K and V, which would read each tile twice and pad L + R to the next power of two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_attention import (
    LOG2E,
    _dot_options,
    decode_splits,
    split_partials,
)

# Splits the reduce kernel combines per step of its loop.
REDUCE_SPLITS = 8


@triton.jit
def _store_latent_kernel(
    latent_ptr,
    cache_ptr,
    slot_ptr,
    stride_lt,
    stride_cb,
    stride_cs,
    block_size,
    width,
    BLOCK_D: tl.constexpr,
):
    """Program t: token t's latent into its slot; slot -1 (padding) writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    # Masked rather than returned early, so a captured graph replays the same code for any slots.
    mask = dims < tl.where(slot >= 0, width, 0)
    safe_slot = tl.maximum(slot, 0)
    dst = (safe_slot // block_size) * stride_cb + (safe_slot % block_size) * stride_cs + dims
    latent = tl.load(latent_ptr + t * stride_lt + dims, mask=mask)
    tl.store(cache_ptr + dst, latent.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_latent_tile(
    q_lat,
    q_pe,
    m_i,
    l_i,
    acc,
    cache_ptr,
    table_ptr,
    keys,
    key_mask,
    lat_dims,
    lat_mask,
    pe_dims,
    pe_mask,
    lora,
    stride_cb,
    stride_cs,
    scale_log2,
    extra_mask,
    BLOCK_SIZE: tl.constexpr,
    HAS_EXTRA_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One step of the online softmax: rows q = [q_lat, q_pe] ([M, L], [M, R], in the cache
    dtype, float32 when UPCAST_DOT) against the latents of key positions `keys` [N]."""
    pages = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    rows = pages * stride_cb + (keys % BLOCK_SIZE) * stride_cs
    c_kv = tl.load(
        cache_ptr + rows[:, None] + lat_dims[None, :],
        mask=key_mask[:, None] & lat_mask[None, :],
        other=0.0,
    )
    k_pe = tl.load(
        cache_ptr + rows[:, None] + lora + pe_dims[None, :],
        mask=key_mask[:, None] & pe_mask[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        c_kv = c_kv.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    qk = tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
    qk = tl.dot(q_lat, tl.trans(c_kv), qk, input_precision=DOT_PRECISION) * scale_log2
    valid = key_mask[None, :]
    if HAS_EXTRA_MASK:
        valid = valid & extra_mask
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # Rows that have seen no valid key yet keep m = -inf; shift by 0 to avoid (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # Weights rounded to the cache dtype before P @ V, as flash attention does.
    p = p.to(cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        p = p.to(tl.float32)
    # The value is c_kv itself: the tile already loaded for the scores.
    acc = acc * alpha[:, None] + tl.dot(p, c_kv, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_latent_query(
    q_ptr,
    tokens,
    heads,
    row_mask,
    stride_qt,
    stride_qh,
    lat_dims,
    lat_mask,
    pe_dims,
    pe_mask,
    lora,
    cache_ptr,
    UPCAST_DOT: tl.constexpr,
):
    """Rows (token, head) of the query as [q_lat, q_pe] in the cache dtype (float32 when
    UPCAST_DOT), as the reference rounds the query to the cache dtype."""
    base = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(base + lat_dims[None, :], mask=row_mask[:, None] & lat_mask[None, :])
    q_pe = tl.load(base + lora + pe_dims[None, :], mask=row_mask[:, None] & pe_mask[None, :])
    q_lat = q_lat.to(cache_ptr.dtype.element_ty)
    q_pe = q_pe.to(cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe


@triton.jit
def _latent_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    num_heads,
    lora,
    rope,
    partition,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (head block, seq, split): BLOCK_H heads over keys [split * partition, ...)."""
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition
    end = tl.minimum(start + partition, seq_len)

    head_mask = heads < num_heads
    lat_dims = tl.arange(0, BLOCK_L)
    lat_mask = lat_dims < lora
    pe_dims = tl.arange(0, BLOCK_R)
    pe_mask = pe_dims < rope
    q_lat, q_pe = _load_latent_query(
        q_ptr,
        tl.zeros([BLOCK_H], tl.int64) + seq,
        heads,
        head_mask,
        stride_qt,
        stride_qh,
        lat_dims,
        lat_mask,
        pe_dims,
        pe_mask,
        lora,
        cache_ptr,
        UPCAST_DOT,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _attend_latent_tile(
            q_lat,
            q_pe,
            m_i,
            l_i,
            acc,
            cache_ptr,
            table_ptr,
            keys,
            keys < end,
            lat_dims,
            lat_mask,
            pe_dims,
            pe_mask,
            lora,
            stride_cb,
            stride_cs,
            scale_log2,
            None,
            BLOCK_SIZE,
            False,
            DOT_PRECISION,
            UPCAST_DOT,
        )

    # An empty split (past this sequence's end) has l = 0: write zeros and lse = -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_mask = head_mask[:, None] & lat_mask[None, :]
    if ONE_SPLIT:
        out = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + lat_dims[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_L + lat_dims[None, :], o, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_mask)


@triton.jit
def _latent_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    lora,
    partition,
    num_splits,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Program (seq, head): the splits' normalized outputs weighted by exp2(lse), CHUNK_S splits
    a step, so the tile stays [CHUNK_S, BLOCK_L] however many splits there are."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    active = tl.cdiv(tl.load(seq_lens_ptr + seq), partition)
    base = (seq * num_heads + head) * num_splits
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < active, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # A padding row with no context (seq_len 0) has no valid split: shift by 0, write zeros.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    dims = tl.arange(0, BLOCK_L)
    dim_mask = dims < lora
    o = tl.zeros([BLOCK_L], tl.float32)
    total = 0.0
    for s0 in range(0, active, CHUNK_S):
        chunk = s0 + tl.arange(0, CHUNK_S)
        chunk_mask = chunk < active
        chunk_lse = tl.load(part_lse_ptr + base + chunk, mask=chunk_mask, other=float("-inf"))
        weights = tl.math.exp2(chunk_lse - lse_max)
        parts = tl.load(
            part_out_ptr + (base + chunk)[:, None] * BLOCK_L + dims[None, :],
            mask=chunk_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        o += tl.sum(parts * weights[:, None], axis=0)
        total += tl.sum(weights, axis=0)
    o = o / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@triton.jit
def _latent_prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    num_seqs,
    num_heads,
    lora,
    rope,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (q tile, head block): BLOCK_Q queries of one sequence x BLOCK_H heads (rows of the
    tile are (query, head) pairs), causal over that sequence's paged context."""
    tile = tl.program_id(0)
    head_block = tl.program_id(1)
    # Sequence b owns tiles [qsl[b] // BLOCK_Q + b, ...): find b by binary search, so the grid
    # (num_tokens // BLOCK_Q + num_seqs) needs no host-side knowledge of the sequence lengths.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_first < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prior = seq_len - q_len  # tokens cached before this chunk

        r = tl.arange(0, BLOCK_Q * BLOCK_H)
        query = q_first + r // BLOCK_H
        heads = head_block * BLOCK_H + r % BLOCK_H
        row_mask = (query < q_len) & (heads < num_heads)
        lat_dims = tl.arange(0, BLOCK_L)
        lat_mask = lat_dims < lora
        pe_dims = tl.arange(0, BLOCK_R)
        pe_mask = pe_dims < rope
        tokens = (q_start + query).to(tl.int64)
        q_lat, q_pe = _load_latent_query(
            q_ptr,
            tokens,
            heads,
            row_mask,
            stride_qt,
            stride_qh,
            lat_dims,
            lat_mask,
            pe_dims,
            pe_mask,
            lora,
            cache_ptr,
            UPCAST_DOT,
        )
        q_pos = prior + query  # each row attends to keys 0 .. q_pos

        m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_L], tl.float32)
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_end = prior + tl.minimum(q_first + BLOCK_Q, q_len)
        # Keys below the tile's first query position need no causal mask.
        full_end = prior + q_first + 1
        full_end = full_end - full_end % BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_latent_tile(
                q_lat,
                q_pe,
                m_i,
                l_i,
                acc,
                cache_ptr,
                table_ptr,
                keys,
                keys < kv_end,
                lat_dims,
                lat_mask,
                pe_dims,
                pe_mask,
                lora,
                stride_cb,
                stride_cs,
                scale_log2,
                None,
                BLOCK_SIZE,
                False,
                DOT_PRECISION,
                UPCAST_DOT,
            )
        for n0 in range(full_end, kv_end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_latent_tile(
                q_lat,
                q_pe,
                m_i,
                l_i,
                acc,
                cache_ptr,
                table_ptr,
                keys,
                keys < kv_end,
                lat_dims,
                lat_mask,
                pe_dims,
                pe_mask,
                lora,
                stride_cb,
                stride_cs,
                scale_log2,
                keys[None, :] <= q_pos[:, None],
                BLOCK_SIZE,
                True,
                DOT_PRECISION,
                UPCAST_DOT,
            )
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        out = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + lat_dims[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & lat_mask[None, :])


def _block(width: int) -> int:
    """A latent part's width padded to a power of two (masked), at least tl.dot's minimum 16."""
    return max(16, triton.next_power_of_2(width))


@dataclass(frozen=True, slots=True)
class LatentTileConfig:
    """Tile sizes and launch options of one latent attention launch."""

    block_h: int  # heads per program (decode: the M dimension of its dots); a power of two
    block_m: int  # prefill: (query, head) rows per program, block_m // block_h queries
    block_n: int  # keys per step of the online softmax
    num_warps: int
    num_stages: int


# At DeepSeek-V3's width (L = 512, R = 64) a row of the f32 accumulator is 512 numbers. Tiles are
# chosen from sm_90 compiles (ptxas register and spill reports: no spills, decode at 128
# registers so two programs share an SM), not yet from timings on a GPU. float32 (tests,
# debugging) uses exact FMA dots, which need far more registers.
def latent_decode_config(lora: int, dtype: torch.dtype) -> LatentTileConfig:
    if dtype == torch.float32:
        return LatentTileConfig(block_h=16, block_m=16, block_n=16, num_warps=8, num_stages=2)
    if _block(lora) <= 128:
        return LatentTileConfig(block_h=16, block_m=16, block_n=64, num_warps=4, num_stages=3)
    return LatentTileConfig(block_h=16, block_m=16, block_n=32, num_warps=8, num_stages=2)


def latent_prefill_config(lora: int, dtype: torch.dtype) -> LatentTileConfig:
    if dtype == torch.float32:
        return LatentTileConfig(block_h=16, block_m=16, block_n=16, num_warps=8, num_stages=2)
    if _block(lora) <= 128:
        return LatentTileConfig(block_h=16, block_m=64, block_n=64, num_warps=8, num_stages=3)
    return LatentTileConfig(block_h=16, block_m=32, block_n=32, num_warps=8, num_stages=2)


def _check_shapes(query: torch.Tensor, cache: torch.Tensor, value_dim: int) -> None:
    if cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"a latent cache is [blocks, block_size, 1, L + R], got {cache.shape}")
    if cache.stride(-1) != 1:
        raise ValueError("the latent cache must have a contiguous last dim")
    if query.shape[-1] != cache.shape[-1]:
        raise ValueError(f"query width {query.shape[-1]} != latent width {cache.shape[-1]}")
    if not 0 < value_dim <= cache.shape[-1]:
        raise ValueError(f"value_dim {value_dim} outside the latent width {cache.shape[-1]}")


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as `mla_ref.store_latent`; latent may be a strided view of its tokens."""
    num_tokens, width = latent.shape[0], latent.shape[-1]
    if num_tokens == 0:
        return
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    if cache.stride(-1) != 1:
        raise ValueError("the latent cache must have a contiguous last dim")
    _store_latent_kernel[(num_tokens,)](
        latent,
        cache,
        slot_mapping,
        latent.stride(0),
        cache.stride(0),
        cache.stride(1),
        cache.shape[1],
        width,
        BLOCK_D=triton.next_power_of_2(width),
    )


def latent_decode_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    partition: int | None = None,
    config: LatentTileConfig | None = None,
) -> torch.Tensor:
    """One query per sequence (query [B, H, L + R]) into out [B, H, L]; `partition` (tokens per
    split, a multiple of config.block_n) overrides the planned split."""
    batch, num_heads, width = query.shape
    block_size = cache.shape[1]
    lora = out.shape[-1]
    config = config or latent_decode_config(lora, cache.dtype)
    block_h = min(config.block_h, _block(num_heads))
    head_blocks = triton.cdiv(num_heads, block_h)
    max_context = max(1, block_tables.shape[1] * block_size)
    num_splits, partition = decode_splits(
        batch * head_blocks, max_context, config.block_n, query.device, partition
    )
    block_l = _block(lora)
    one_split = num_splits == 1
    part_out, part_lse = split_partials(out, num_heads, num_splits, block_l)
    # Head blocks vary fastest: those of one (sequence, split) run side by side, so with more
    # heads than a block all but the first find the latents in L2.
    _latent_decode_kernel[(head_blocks, batch, num_splits)](
        query,
        cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        lora,
        width - lora,
        partition,
        num_splits,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        BLOCK_L=block_l,
        BLOCK_R=_block(width - lora),
        ONE_SPLIT=one_split,
        **_dot_options(query, cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not one_split:
        _latent_decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            seq_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            lora,
            partition,
            num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            CHUNK_S=min(REDUCE_SPLITS, triton.next_power_of_2(num_splits)),
            BLOCK_L=block_l,
            num_warps=4,
        )
    return out


def latent_prefill_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: LatentTileConfig | None = None,
) -> torch.Tensor:
    """Varlen causal latent attention, into out [T, H, L], of chunks whose earlier tokens (and
    the chunk's own latents) are in the paged cache."""
    num_tokens, num_heads, width = query.shape
    lora = out.shape[-1]
    config = config or latent_prefill_config(lora, cache.dtype)
    # Rows are (query, head) pairs: few heads leave room for more queries, never padding heads.
    block_h = min(config.block_h, triton.next_power_of_2(num_heads), config.block_m)
    block_q = config.block_m // block_h
    batch = seq_lens.shape[0]
    grid = (num_tokens // block_q + batch, triton.cdiv(num_heads, block_h))
    _latent_prefill_kernel[grid](
        query,
        cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        batch,
        num_heads,
        lora,
        width - lora,
        BLOCK_SIZE=cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        BLOCK_L=_block(lora),
        BLOCK_R=_block(width - lora),
        **_dot_options(query, cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


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
    """Same contract as `mla_ref.latent_attention`; returns a new contiguous [T, H, value_dim].

    Decode-only batches (max_query_len == 1) take the split-K kernel, any other the varlen one.
    """
    num_tokens, num_heads = query.shape[:2]
    out = torch.empty((num_tokens, num_heads, value_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    _check_shapes(query, cache, value_dim)
    if query.stride(-1) != 1:
        query = query.contiguous()
    # The kernels index these with unit strides (no-ops for the runner's tensors).
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 1 and num_tokens == seq_lens.shape[0]:
        return latent_decode_attention(query, cache, block_tables, seq_lens, scale, out)
    return latent_prefill_attention(
        query, cache, block_tables, seq_lens, query_start_loc, scale, out
    )
