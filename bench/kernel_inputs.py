"""The attention kernels' benchmark inputs (bench.kernels, bench.kernels_mixers,
bench.cpu_attention): a paged cache of Llama-3-8B's attention shape holding every sequence's
context on shuffled pages, and the batch's queries."""

from __future__ import annotations

import torch

# Llama-3-8B attention: 32 q heads over 8 KV heads of 128, bf16 pages of 16 tokens.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def paged_inputs(
    context_lens: list[int],
    query_lens: list[int],
    seed: int = 0,
    heads: tuple[int, int, int] = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM),
    device: str = "cuda",
    dtype: torch.dtype = DTYPE,
) -> dict:
    """One cache holding every sequence's context on shuffled pages, and the batch's queries
    (`heads`: query heads, KV heads, head size; Llama-3-8B's by default)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks) + 1
    pages = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32, device=device)
    offset = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = pages[offset : offset + n]
        offset += n
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    query = torch.randn(sum(query_lens), num_heads, head_dim, device=device, generator=gen)
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0)
    return dict(
        query=query.to(dtype),
        k_cache=torch.randn(shape, device=device, generator=gen).to(dtype),
        v_cache=torch.randn(shape, device=device, generator=gen).to(dtype),
        block_tables=tables,
        seq_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
        query_start_loc=starts,
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
    )
