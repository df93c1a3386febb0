"""Triton paged attention matching `attention_ref.paged_attention`: a split-K (flash-decoding)
kernel for decode-only batches and a varlen causal kernel for prefill/extend chunks.

Both read K/V straight from the paged cache through the block tables, gathering one token row per
key (so a key tile may span several pages of any power-of-two block size), pack the q heads that
share a KV head into one tile (K/V read once per group), and accumulate in float32 with an online
softmax in base 2. Neither needs a host sync when max_query_len is given, so both can be captured
in CUDA graphs. Any head_dim works (masked up to a power of two, at least 16, as tl.dot wants);
block sizes must be powers of two. Decodes that share a step with prefill chunks go through the
varlen kernel, unsplit.

A layer's sliding window or local chunk (constexprs: a layer's constants, a compile each) starts
each query's keys at its first visible one: pages before it are never read (they may be freed,
-1), and a decode costs O(window), its splits planned over the window alone. Sinks (a logit per
head, no value) start the online softmax, or join the reduce of a split decode.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.attention_ref import check_visibility

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # as the kernels read it

# Decode splits: a split covers at least this many tokens, and the split count aims at this many
# programs per SM so that small batches with long contexts still fill the device.
MIN_PARTITION_TOKENS = 128
PROGRAMS_PER_SM = 4
# SM count assumed off-GPU (under TRITON_INTERPRET) so the interpreter runs the same split plans.
DEFAULT_SM_COUNT = 132


@triton.jit
def _first_visible_key(position, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    """`attention_ref.first_visible_keys` of a position (or a tensor of them)."""
    first = position * 0
    if WINDOW > 0:
        first = tl.maximum(first, position - WINDOW + 1)
    if CHUNK > 0:
        first = tl.maximum(first, position - position % CHUNK)
    return first


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head_offset,
    keys,
    key_mask,
    dims,
    dim_mask,
    stride_cb,
    stride_cs,
    scale_log2,
    extra_mask,
    BLOCK_SIZE: tl.constexpr,
    HAS_EXTRA_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One step of the online softmax: q [M, D] against the key rows `keys` [N] of one sequence.

    q is already in the cache dtype (float32 when UPCAST_DOT).
    """
    pages = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    rows = pages * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head_offset
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
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
    v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    num_heads,
    group,
    head_dim,
    partition,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (seq, kv head, split): the group's q heads over keys [begin + split * partition,
    ...), begin: the tile holding the query's first visible key."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = _first_visible_key(seq_len - 1, WINDOW, CHUNK)
    start = first - first % BLOCK_N + split * partition
    end = tl.minimum(start + partition, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    head_mask = g < group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask)
    q = q.to(k_cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    if HAS_SINKS and ONE_SPLIT:  # the sink starts the softmax (split ones join in the reduce)
        m_i = tl.load(sinks_ptr + heads, mask=head_mask, other=float("-inf")).to(tl.float32)
        m_i = m_i * _LOG2E
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_ch
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            kv_head_offset,
            keys,
            (keys >= first) & (keys < end),
            dims,
            dim_mask,
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
    if ONE_SPLIT:
        out = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], o, mask=q_mask)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    partition,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program (seq, q head): combine the splits' normalized outputs weighted by exp2(lse), and
    the sink's exp2 in the denominator."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = _first_visible_key(seq_len - 1, WINDOW, CHUNK)
    active = tl.cdiv(seq_len - (first - first % BLOCK_N), partition)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < active
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    base = (seq * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        lse_max = tl.maximum(lse_max, sink)
    weights = tl.where(split_mask, tl.math.exp2(lse - lse_max), 0.0)
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weights, axis=0)
    if HAS_SINKS:
        total += tl.math.exp2(sink - lse_max)
    o = tl.sum(parts * weights[:, None], axis=0) / total
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    num_seqs,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (q tile, kv head): BLOCK_Q queries of one sequence x the group's q heads (rows of
    the tile are (query, head) pairs), causal over that sequence's paged context from each
    query's first visible key."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
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

        r = tl.arange(0, BLOCK_M)
        query = q_first + r // group
        heads = kv_head * group + r % group
        row_mask = (r < BLOCK_Q * group) & (query < q_len)
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < head_dim
        q_mask = row_mask[:, None] & dim_mask[None, :]
        tokens = (q_start + query).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=q_mask,
        )
        q = q.to(k_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        q_pos = prior + query  # each row attends to keys first .. q_pos
        first = _first_visible_key(q_pos, WINDOW, CHUNK)

        if HAS_SINKS:  # the sink starts each row's softmax
            m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=float("-inf")).to(tl.float32)
            m_i = m_i * _LOG2E
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_head_offset = kv_head.to(tl.int64) * stride_ch
        kv_end = prior + tl.minimum(q_first + BLOCK_Q, q_len)
        kv_first = _first_visible_key(prior + q_first, WINDOW, CHUNK)  # the tile's first key
        # Keys every row of the tile sees need no mask: from the last row's first key (a tile
        # up) to the first row's position (a tile down).
        full_start = _first_visible_key(kv_end - 1, WINDOW, CHUNK)
        full_start = (full_start + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_end = prior + q_first + 1
        full_end = full_end - full_end % BLOCK_N
        if WINDOW > 0 or CHUNK > 0:  # below them, the edge of the window or chunk
            for n0 in range(kv_first - kv_first % BLOCK_N, tl.minimum(full_start, kv_end), BLOCK_N):
                keys = n0 + tl.arange(0, BLOCK_N)
                m_i, l_i, acc = _attend_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    k_cache_ptr,
                    v_cache_ptr,
                    table_ptr,
                    kv_head_offset,
                    keys,
                    (keys >= kv_first) & (keys < kv_end),
                    dims,
                    dim_mask,
                    stride_cb,
                    stride_cs,
                    scale_log2,
                    (keys[None, :] >= first[:, None]) & (keys[None, :] <= q_pos[:, None]),
                    BLOCK_SIZE,
                    True,
                    DOT_PRECISION,
                    UPCAST_DOT,
                )
        for n0 in range(full_start, full_end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                table_ptr,
                kv_head_offset,
                keys,
                keys < kv_end,
                dims,
                dim_mask,
                stride_cb,
                stride_cs,
                scale_log2,
                None,
                BLOCK_SIZE,
                False,
                DOT_PRECISION,
                UPCAST_DOT,
            )
        # Above them, the causal diagonal (every row's first key lies below).
        for n0 in range(tl.maximum(full_start, full_end), kv_end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                table_ptr,
                kv_head_offset,
                keys,
                keys < kv_end,
                dims,
                dim_mask,
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
        out = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def _block_d(head_dim: int) -> int:
    """Head dim padded to a power of two (masked), at least tl.dot's minimum of 16."""
    return max(16, triton.next_power_of_2(head_dim))


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile sizes and launch options of one attention kernel launch."""

    block_m: int  # prefill: (query, head) rows per program; unused by decode
    block_n: int  # keys per step of the online softmax
    num_warps: int
    num_stages: int


# Chosen from sm_90 compiles (ptxas register and spill reports), not yet from timings on a GPU:
# no spills, and decode kept near 120 registers so several programs share an SM to keep loads in
# flight. float32 (tests, debugging) uses exact FMA dots, which need far more registers.
def decode_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        return TileConfig(block_m=16, block_n=32, num_warps=8, num_stages=3)
    if block_d <= 128:
        return TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    return TileConfig(block_m=16, block_n=32, num_warps=8, num_stages=2)


def prefill_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        return TileConfig(block_m=16, block_n=32, num_warps=8, num_stages=3)
    if block_d <= 128:
        return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return TileConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_decode_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, sm_count: int
) -> tuple[int, int]:
    """(num_splits, partition tokens) for a decode batch whose contexts are at most max_context.

    Uses only host-known shapes (the block-table width bounds the context), never seq_lens, so
    the plan is the same on every replay of a captured graph.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sm_count, programs)
    splits = max(1, min(wanted, triton.cdiv(max_context, MIN_PARTITION_TOKENS)))
    partition = triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
    return triton.cdiv(max_context, partition), partition


def decode_splits(
    programs: int,
    max_context: int,
    block_n: int,
    device: torch.device,
    partition: int | None = None,
) -> tuple[int, int]:
    """(num_splits, partition tokens) of a decode call: planned for `programs` programs a split
    (sequences x KV heads, or head blocks), or, with `partition` given, that many tokens each."""
    if partition is None:
        return plan_decode_splits(programs, 1, max_context, block_n, _sm_count(device))
    return triton.cdiv(max_context, partition), partition


def split_partials(
    out: torch.Tensor, num_heads: int, num_splits: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 buffers for each split's partial output [B, H, S, width] and log-sum-exp
    [B, H, S], which the reduce kernel combines; with one split, `out` twice (unused)."""
    if num_splits == 1:
        return out, out
    batch, device = out.shape[0], out.device
    return (
        torch.empty((batch, num_heads, num_splits, width), dtype=torch.float32, device=device),
        torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device),
    )


def _dot_options(query: torch.Tensor, cache_dtype: torch.dtype) -> dict:
    # Off-GPU the kernels run in Triton's interpreter, whose tl.dot multiplies bfloat16 as its raw
    # uint16 bits: there the operands (already rounded to the cache dtype) go up to float32, which
    # holds them exactly. float32 dots must not use TF32 tensor cores (they would lose ~1e-3).
    upcast = query.device.type != "cuda"
    exact = upcast or cache_dtype == torch.float32
    return {"DOT_PRECISION": "ieee" if exact else None, "UPCAST_DOT": upcast}


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} q heads do not group over {num_kv_heads} kv heads")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two")


def decode_span(max_context: int, block_n: int, window: int = 0, chunk: int = 0) -> int:
    """How many keys a decode program's splits may cover: the context, or under a window or a
    chunk only the keys a query sees from the start of the tile holding its first one."""
    reach = min((n for n in (window, chunk) if n), default=0)
    return min(max_context, reach + block_n - 1) if reach else max_context


def _sinks_arg(sinks: torch.Tensor | None, query: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The sinks pointer a kernel takes (the query's, unread, without sinks) and HAS_SINKS."""
    if sinks is None:
        return query, False
    return sinks.contiguous(), True


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    partition: int | None = None,
    config: TileConfig | None = None,
    *,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (query [B, H, D]) into `out`; `partition` (tokens per split, a
    multiple of config.block_n) overrides the planned split."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    config = config or decode_config(head_dim, k_cache.dtype)
    # Host-known shapes only (the table's width, the layer's window or chunk): the same plan on
    # every replay of a captured graph.
    max_context = max(1, block_tables.shape[1] * block_size)
    span = decode_span(max_context, config.block_n, window, chunk)
    num_splits, partition = decode_splits(
        batch * num_kv_heads, span, config.block_n, query.device, partition
    )
    sinks_ptr, has_sinks = _sinks_arg(sinks, query)
    block_d = _block_d(head_dim)
    one_split = num_splits == 1
    part_out, part_lse = split_partials(out, num_heads, num_splits, block_d)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        sinks_ptr,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        group,
        head_dim,
        partition,
        num_splits,
        BLOCK_SIZE=block_size,
        # tl.dot wants at least 16 rows; the padded head rows are masked.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        ONE_SPLIT=one_split,
        WINDOW=window,
        CHUNK=chunk,
        HAS_SINKS=has_sinks,
        **_dot_options(query, k_cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not one_split:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            seq_lens,
            sinks_ptr,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            partition,
            num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            BLOCK_N=config.block_n,
            WINDOW=window,
            CHUNK=chunk,
            HAS_SINKS=has_sinks,
            num_warps=4,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: TileConfig | None = None,
    *,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention, into `out`, of chunks whose earlier tokens (and the chunk's own
    K/V) are in the paged cache."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    config = config or prefill_config(head_dim, k_cache.dtype)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    batch = seq_lens.shape[0]
    grid = (num_tokens // block_q + batch, num_kv_heads)
    sinks_ptr, has_sinks = _sinks_arg(sinks, query)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        sinks_ptr,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        batch,
        group,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=_block_d(head_dim),
        WINDOW=window,
        CHUNK=chunk,
        HAS_SINKS=has_sinks,
        **_dot_options(query, k_cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
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
    """Same contract as `attention_ref.paged_attention`; returns a new contiguous tensor.

    Decode-only batches (max_query_len == 1) take the split-K kernel, any other the varlen one.
    """
    num_tokens = query.shape[0]
    check_visibility(window, chunk, sinks, query.shape[1])
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    _check_shapes(query, k_cache, v_cache)
    local = dict(window=window, chunk=chunk, sinks=sinks)
    if query.stride(-1) != 1:
        query = query.contiguous()
    # The kernels index these with unit strides (no-ops for the runner's tensors).
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 1 and num_tokens == seq_lens.shape[0]:
        return paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, out, **local
        )
    return paged_prefill_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, **local
    )
