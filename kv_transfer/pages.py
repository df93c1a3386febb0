"""Pack and unpack pages for every transport: the kernel for the pool's device, and how a send
is cut into chunks (a range of layers times a slice of the blocks) that pipeline.

A send may move a slice of each page's KV heads (`heads`, a range in that pool) into a slice of
another pool's (between tensor-parallel groups of different sizes): such copies go through torch
indexing on any device; whole pages keep the fast kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from pdserve.engine.kv.cache import KVLayout
from pdserve.kernels import kv_pages


def _kernels(device: torch.device):
    if device.type == "cuda":
        from pdserve.kernels import kv_pages_triton

        return kv_pages_triton
    return kv_pages


Heads = tuple[int, int] | None  # [h0, h1) of a pool's KV heads; None: all of them


def _whole(kv: torch.Tensor, heads: Heads) -> bool:
    return heads is None or (heads[0] == 0 and heads[1] == kv.shape[4])


def _heads(kv: torch.Tensor, layers: tuple[int, int], heads: Heads) -> torch.Tensor:
    """The pool's pages of layers [l0, l1), only heads [h0, h1) of each (a view)."""
    h0, h1 = heads if heads is not None else (0, kv.shape[4])
    return kv[layers[0] : layers[1], :, :, :, h0:h1]


def gather(kv: torch.Tensor, ids: torch.Tensor, layers: tuple[int, int], out=None, heads=None):
    if _whole(kv, heads):
        return _kernels(kv.device).gather_blocks(kv, ids, layers, out=out)
    data = torch.index_select(_heads(kv, layers, heads), 2, ids.to(kv.device))
    if out is None:
        return data
    out.copy_(data)
    return out


def scatter(
    kv: torch.Tensor, buffer: torch.Tensor, ids: torch.Tensor, layers: tuple[int, int], heads=None
):
    if _whole(kv, heads):
        _kernels(kv.device).scatter_blocks(kv, buffer, ids, layers)
        return
    _heads(kv, layers, heads).index_copy_(2, ids.to(kv.device), buffer)


def copy(
    src_kv, src_ids, dst_kv, dst_ids, layers: tuple[int, int], src_heads=None, dst_heads=None
) -> None:
    """Blocks src_ids (heads src_heads of each page) into blocks dst_ids (heads dst_heads)."""
    if _whole(src_kv, src_heads) and _whole(dst_kv, dst_heads):
        _kernels(src_kv.device).copy_blocks(src_kv, src_ids, dst_kv, dst_ids, layers)
        return
    src_ids = kv_pages.as_block_ids(src_ids, src_kv.device)
    dst_ids = kv_pages.as_block_ids(dst_ids, dst_kv.device)
    data = torch.index_select(_heads(src_kv, layers, src_heads), 2, src_ids)
    _heads(dst_kv, layers, dst_heads).index_copy_(2, dst_ids, data.to(dst_kv.device))


def write(
    kv: torch.Tensor, layer: int, plane: int, ids: torch.Tensor, data: torch.Tensor, heads=None
) -> None:
    """Write data [n, *page] into blocks ids of one plane's pages of one layer (plane 0: K, or
    MLA's latent; 1: V), only heads [h0, h1) of each page: data's pages hold that many."""
    if _whole(kv, heads):
        kv_pages.write_pages(kv[layer, plane], ids, data)
        return
    h0, h1 = heads
    kv[layer, plane, :, :, h0:h1].index_copy_(0, ids.to(kv.device), data)


def sliced(layout: KVLayout, heads: Heads) -> KVLayout:
    """The layout of pages cut to a slice of their heads (what a chunk of them holds)."""
    return layout if heads is None else replace(layout, num_kv_heads=heads[1] - heads[0])


def source_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of the runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def pool_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """[slots, planes, num_blocks, block_size, num_kv_heads, page_width], as in KVPool (a slot per
    layer, or per layer of the largest KV group: what transfers call layers)."""
    return (
        layout.num_slots,
        layout.planes,
        num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        layout.page_width,
    )


def page_bytes(layout: KVLayout) -> int:
    """Bytes of one block of one layer, all its planes (K and V, or the latent)."""
    return layout.bytes_per_block // layout.num_slots


def plane_bytes(layout: KVLayout) -> int:
    """Bytes of one block of one layer of one plane: a K, a V or a latent page."""
    return page_bytes(layout) // layout.planes


@dataclass(frozen=True, slots=True)
class Chunk:
    layers: tuple[int, int]
    lo: int  # slice [lo, hi) of the send's block lists
    hi: int

    def nbytes(self, layout: KVLayout) -> int:
        return (self.layers[1] - self.layers[0]) * (self.hi - self.lo) * page_bytes(layout)

    def shape(self, layout: KVLayout) -> tuple[int, ...]:
        return (
            self.layers[1] - self.layers[0],
            layout.planes,
            self.hi - self.lo,
            layout.block_size,
            layout.num_kv_heads,
            layout.page_width,
        )


def plan_chunks(
    layout: KVLayout, num_blocks: int, layers: tuple[int, int], chunk_bytes: int
) -> Iterator[Chunk]:
    """Cut a send into chunks of about chunk_bytes, layer-major (so the receiver can mark layers
    arrived in order): whole layers while they fit, else slices of the blocks of one layer."""
    l0, l1 = layers
    per_layer = num_blocks * page_bytes(layout)
    if per_layer <= chunk_bytes:
        step = max(1, chunk_bytes // per_layer)
        for a in range(l0, l1, step):
            yield Chunk((a, min(l1, a + step)), 0, num_blocks)
        return
    blocks = max(1, chunk_bytes // page_bytes(layout))
    for a in range(l0, l1):
        for lo in range(0, num_blocks, blocks):
            yield Chunk((a, a + 1), lo, min(num_blocks, lo + blocks))
