"""Causal prefill attention for Hopper (sm_90): `triton_attention.paged_prefill_attention`'s
contract with a tile schedule sized for wgmma and Q read by the tensor memory accelerator (TMA).

What it does differently from the portable kernel:
- Q comes in through a host-side `TensorDescriptor` over [tokens, heads, head_dim]: one TMA box
  [BLOCK_Q, group, head_dim] per program, the group's q heads of BLOCK_Q queries (each box
  dimension at most 256), reshaped to BLOCK_M = 128 (query, head) rows (K/V read once per group,
  as GQA wants); without GQA a 2-D box [BLOCK_Q, head_dim] over [tokens, heads x head_dim].
- Paged K and V are NOT read by TMA: a 2-D descriptor cannot cross pages, and a box per page
  (16 or 32 rows) would cut a key tile into pieces that Triton cannot join without a layout
  shuffle. They are gathered a page at a time instead: each tile's BLOCK_N // block_size page ids
  are read once from the block table and each page's rows are contiguous 16-byte vectors, which
  the compiler pipelines with cp.async over num_stages stages.
- Causal block skipping: key tiles wholly above the diagonal are never visited; tiles wholly below
  it run with no mask at all (no predicate on loads, no select on scores); only the tiles the
  diagonal crosses are masked.
- Programs run longest first (the last q tiles of a sequence see the most keys) with the KV heads
  of one q tile adjacent, so those sharing K/V pages run together and reuse them from L2.

Only full causal attention (no window, chunk or sinks), power-of-two GQA groups and head dims 64
and 128 in half precision: `hopper_prefill_applies` says when; the portable kernel does the rest.
MLA prefill has its own kernel (`triton_mla.latent_attention`) and does not come here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels import triton_attention
from pdserve.kernels.triton_attention import LOG2E, TileConfig, _dot_options

HEAD_DIMS = (64, 128)
HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def descriptors_supported() -> bool:
    """Whether this Triton has host-side tensor descriptors (Triton 3.4 and later)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def hopper_prefill_applies(
    capability: tuple[int, int] | None,
    has_descriptors: bool,
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    block_size: int,
    *,
    window: int = 0,
    chunk: int = 0,
    has_sinks: bool = False,
) -> bool:
    """Whether a prefill call goes to this kernel: an sm_90 or later GPU with a Triton that has
    tensor descriptors, full causal attention in half precision, head dim 64 or 128, and a
    power-of-two GQA group and block size that divide the tiles. Anything else keeps the portable
    kernel."""
    if capability is None or capability < (9, 0) or not has_descriptors:
        return False
    if dtype not in HALF_DTYPES or head_dim not in HEAD_DIMS:
        return False
    if window or chunk or has_sinks:
        return False
    power_of_two = group > 0 and not group & (group - 1)
    config = hopper_prefill_config(head_dim)
    return power_of_two and group <= config.block_m and block_size <= config.block_n


def hopper_prefill_config(head_dim: int) -> TileConfig:
    """wgmma-sized tiles: 128 (query, head) rows as two warpgroups of 64, keys in steps of 64
    (at 128 keys a step the sm_90 compile spills registers at head dim 64 without GQA), 3 stages
    of K/V in flight at head dim 64 and 2 at 128 (shared memory)."""
    if head_dim <= 64:
        return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


@triton.jit
def _page_rows(
    table_ptr,
    n0,
    kv_end,
    kv_head_offset,
    stride_cb,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Cache offsets of keys n0 .. n0 + BLOCK_N (n0 a multiple of BLOCK_N): the tile's page ids
    read once, each page's BLOCK_SIZE rows contiguous. MASKED (the diagonal): pages from kv_end
    on are not read (the block table may end before them)."""
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
    columns = n0 // BLOCK_SIZE + tl.arange(0, PAGES)
    if MASKED:
        pages = tl.load(table_ptr + columns, mask=columns * BLOCK_SIZE < kv_end, other=0)
    else:
        pages = tl.load(table_ptr + columns)
    pages = pages.to(tl.int64)
    slots = tl.arange(0, BLOCK_SIZE).to(tl.int64) * stride_cs
    rows = pages[:, None] * stride_cb + slots[None, :] + kv_head_offset
    return tl.reshape(rows, [BLOCK_N])


@triton.jit
def _online_softmax_step(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    rows,
    dims,
    scale_log2,
    causal,
    DIAGONAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One key tile: q [M, D] against the keys at cache offsets `rows` [N]. Off the diagonal
    nothing is masked; on it, `causal` [M, N] (also false for keys past the chunk's end, whose
    loads it keeps from reading past the block table's pages)."""
    if DIAGONAL:
        key_ok = tl.max(causal.to(tl.int32), axis=0) > 0
        k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :])
    if UPCAST_DOT:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if DIAGONAL:
        qk = tl.where(causal, qk, float("-inf"))
    # Every row sees key 0 in the first tile it visits, so m is finite from the first step.
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DIAGONAL:
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :])
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _hopper_prefill_kernel(
    q_desc,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    num_seqs,
    num_tiles,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Program (kv head, q tile), tiles taken last first: BLOCK_Q queries of one sequence x the
    group's GROUP q heads, causal over that sequence's paged context."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP
    kv_head = tl.program_id(0)
    tile = num_tiles - 1 - tl.program_id(1)
    # Sequence b owns tiles [qsl[b] // BLOCK_Q + b, ...), as in the portable kernel.
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
        prior = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this chunk
        # One TMA box: rows past the tensor's end come back as zeros; rows of the next sequence
        # are read but never stored.
        if GROUP == 1:  # a 2-D box [BLOCK_Q, HEAD_DIM] (a reshape costs registers here)
            q = q_desc.load([(q_start + q_first).to(tl.int32), kv_head * HEAD_DIM])
        else:
            q = q_desc.load([(q_start + q_first).to(tl.int32), kv_head * GROUP, 0])
            q = tl.reshape(q, [BLOCK_M, HEAD_DIM])  # row r: query r // GROUP, head r % GROUP
        q = q.to(k_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        r = tl.arange(0, BLOCK_M)
        query = q_first + r // GROUP
        q_pos = prior + query
        dims = tl.arange(0, HEAD_DIM)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_head_offset = kv_head.to(tl.int64) * stride_ch
        # Keys past the tile's last query are above the diagonal for every row: never visited.
        kv_end = prior + tl.minimum(q_first + BLOCK_Q, q_len)
        # Keys up to the tile's first position are below it for every row: no mask.
        full_end = prior + q_first + 1
        full_end = full_end - full_end % BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            rows = _page_rows(
                table_ptr, n0, kv_end, kv_head_offset, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N,
                False,
            )  # fmt: skip
            m_i, l_i, acc = _online_softmax_step(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, rows, dims, scale_log2, None,
                False, DOT_PRECISION, UPCAST_DOT,
            )  # fmt: skip
        for n0 in range(full_end, kv_end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            rows = _page_rows(
                table_ptr, n0, kv_end, kv_head_offset, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N,
                True,
            )  # fmt: skip
            causal = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] < kv_end)
            m_i, l_i, acc = _online_softmax_step(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, rows, dims, scale_log2, causal,
                True, DOT_PRECISION, UPCAST_DOT,
            )  # fmt: skip
        o = acc / l_i[:, None]
        tokens = (q_start + query).to(tl.int64)
        heads = kv_head * GROUP + r % GROUP
        out = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=(query < q_len)[:, None])


def hopper_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Varlen causal attention, into `out`, of chunks whose earlier tokens (and the chunk's own
    K/V) are in the paged cache; the arguments of `triton_attention.paged_prefill_attention`
    without window, chunk or sinks. `config` overrides the tiles (tests use smaller ones)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    config = config or hopper_prefill_config(head_dim)
    if config.block_m % group or config.block_n % block_size:
        raise ValueError(
            f"group {group} and block_size {block_size} must divide the tiles {config}"
        )
    block_q = config.block_m // group
    if query.stride(2) != 1 or query.stride(1) != head_dim or query.data_ptr() % 16:
        query = query.clone(memory_format=torch.contiguous_format)  # TMA's layout and alignment
    # The box: BLOCK_Q queries x the group's heads x the head dim (each at most 256).
    if group == 1:  # [tokens, heads x head_dim], one head's block of columns
        shape, strides, box = (
            [num_tokens, num_heads * head_dim],
            [query.stride(0), 1],
            [block_q, head_dim],
        )
    else:
        shape, strides, box = list(query.shape), list(query.stride()), [block_q, group, head_dim]
    q_desc = TensorDescriptor(query, shape, strides, box)
    batch = seq_lens.shape[0]
    num_tiles = num_tokens // block_q + batch
    _hopper_prefill_kernel[(num_kv_heads, num_tiles)](
        q_desc,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        batch,
        num_tiles,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        HEAD_DIM=head_dim,
        **_dot_options(query, k_cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


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
    """`triton_attention.paged_attention` (the op table's contract), whose prefill and mixed
    batches take this kernel where `hopper_prefill_applies`; decode-only batches and every other
    GPU keep the portable kernels."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    decode_only = max_query_len == 1 and num_tokens == seq_lens.shape[0]
    applies = num_tokens and not decode_only and num_heads % num_kv_heads == 0
    applies = applies and hopper_prefill_applies(
        _capability(query.device),
        descriptors_supported(),
        k_cache.dtype,
        head_dim,
        num_heads // num_kv_heads,
        block_size,
        window=window,
        chunk=chunk,
        has_sinks=sinks is not None,
    )
    if not applies or query.dtype != k_cache.dtype:
        return triton_attention.paged_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len, window=window, chunk=chunk, sinks=sinks,
        )  # fmt: skip
    triton_attention._check_shapes(query, k_cache, v_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    return hopper_prefill_attention(
        query, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
        query_start_loc.contiguous(), scale, out,
    )  # fmt: skip
