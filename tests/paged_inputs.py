"""Inputs for the paged-attention kernels and their reference, shared by the CPU (interpreter)
and GPU kernel tests."""

from __future__ import annotations

import torch


def paged_inputs(
    context_lens: list[int],
    query_lens: list[int],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> dict:
    """Caches with every sequence's context on shuffled pages (block 0 left unused, as padding
    points there), block tables padded with 0, and queries for each sequence's last tokens; drawn
    on the CPU from `seed`, then moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    blocks = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks) + 2
    pages = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor(pages[:n], dtype=torch.int32)
        pages = pages[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    return dict(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
        query_start_loc=starts.to(torch.int64).to(device),
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
    )


# What a layer sees, as paged_attention's keyword arguments (`attention_pattern` draws the sinks):
# window 12 and chunk 16 are divided by block size 4, not by 5, and the window not by 16.
PATTERNS = {
    "window": dict(window=12),
    "chunk": dict(chunk=16),
    "sinks": dict(sinks=True),
    "window+sinks": dict(window=12, sinks=True),
}


def attention_pattern(name: str, num_heads: int, device: str = "cpu") -> dict:
    """PATTERNS[name] with its sinks, if any, drawn for num_heads heads: logits from -1 to 4, of
    the size of the log-sum-exp of a few to a hundred scores, so they take a real share."""
    args = dict(PATTERNS[name])
    if args.pop("sinks", False):
        gen = torch.Generator().manual_seed(num_heads)
        args["sinks"] = (torch.rand(num_heads, generator=gen) * 5 - 1).to(device)
    return args


def unseen_blocks(
    inputs: dict, window: int = 0, chunk: int = 0, sinks: torch.Tensor | None = None
) -> list[list[int]]:
    """Each sequence's block-table columns that no query of it sees: the blocks wholly before its
    first query's first visible key, which a KV manager may free (-1) under a window or chunk.
    Takes a pattern's arguments whole (sinks change nothing here)."""
    from pdserve.kernels.attention_ref import first_visible_keys

    block_size = inputs["k_cache"].shape[1]
    q_lens = (inputs["query_start_loc"][1:] - inputs["query_start_loc"][:-1]).cpu()
    firsts = first_visible_keys(inputs["seq_lens"].cpu() - q_lens, window, chunk)
    return [list(range(int(first) // block_size)) for first in firsts]


def with_unseen_blocks(inputs: dict, fill: float | None, **pattern) -> dict:
    """`inputs` whose unseen blocks (`unseen_blocks`) are freed (-1), or with `fill`, moved to new
    pages holding nothing but that value (NaN: any read of them shows)."""
    tables = inputs["block_tables"].clone()
    k_cache, v_cache = inputs["k_cache"], inputs["v_cache"]
    columns = unseen_blocks(inputs, **pattern)
    if fill is None:
        for b, cols in enumerate(columns):
            tables[b, cols] = -1
    else:
        extra = sum(len(cols) for cols in columns)
        num_blocks = k_cache.shape[0]
        page = torch.full((extra, *k_cache.shape[1:]), fill, dtype=k_cache.dtype)
        k_cache = torch.cat([k_cache, page.to(k_cache.device)])
        v_cache = torch.cat([v_cache, page.to(v_cache.device)])
        for b, cols in enumerate(columns):
            ids = torch.arange(num_blocks, num_blocks + len(cols), dtype=tables.dtype)
            tables[b, cols] = ids.to(tables.device)
            num_blocks += len(cols)
    return dict(inputs, block_tables=tables, k_cache=k_cache, v_cache=v_cache)
