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
