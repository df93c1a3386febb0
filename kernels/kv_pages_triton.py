"""Triton kernels for moving KV pages on GPU, with the signatures of `pdserve.kernels.kv_pages`.

One kernel copies page rows (one plane's page, K, V or MLA's latent, of one block of one layer)
from an indexed source to an indexed destination; gather, scatter and pool-to-pool copy are its
three uses. Pages are moved as same-width integers, so every dtype arrives bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_pages import (
    as_block_ids,
    check_pools,
    check_scatter_buffer,
    gather_buffer,
    layer_range,
)

_TILE = 1024
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_pages_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_stride_layer,
    src_stride_kv,
    src_stride_block,
    dst_stride_layer,
    dst_stride_kv,
    dst_stride_block,
    page_numel,
    TILE: tl.constexpr,
    PLANES: tl.constexpr,  # 2: K and V; 1: MLA's latent
):
    i = tl.program_id(0)  # which block of the mapping
    row = tl.program_id(1)  # which (layer, plane) page row
    tile = tl.program_id(2)
    layer = (row // PLANES).to(tl.int64)  # int64: offsets of big pools overflow int32
    kv = (row % PLANES).to(tl.int64)
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    src_base = layer * src_stride_layer + kv * src_stride_kv + src_block * src_stride_block
    dst_base = layer * dst_stride_layer + kv * dst_stride_kv + dst_block * dst_stride_block
    offs = tile * TILE + tl.arange(0, TILE)
    mask = offs < page_numel
    vals = tl.load(src_ptr + src_base + offs, mask=mask)
    tl.store(dst_ptr + dst_base + offs, vals, mask=mask)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()])


def _launch(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """src, dst: [L, planes, N, *page] views (pages contiguous); ids index dim 2 of each."""
    page_numel = src[0, 0, 0].numel()
    if src[0, 0, 0].stride()[-1] != 1 or not src[0, 0, 0].is_contiguous():
        raise ValueError("pages must be contiguous")
    if not dst[0, 0, 0].is_contiguous():
        raise ValueError("pages must be contiguous")
    n = src_ids.numel()
    if n == 0:
        return
    planes = src.shape[1]
    if dst.shape[1] != planes:
        raise ValueError(f"{planes} planes copied into {dst.shape[1]}")
    grid = (n, src.shape[0] * planes, triton.cdiv(page_numel, _TILE))
    _copy_pages_kernel[grid](
        _as_int(src),
        _as_int(dst),
        src_ids,
        dst_ids,
        src.stride(0),
        src.stride(1),
        src.stride(2),
        dst.stride(0),
        dst.stride(1),
        dst.stride(2),
        page_numel,
        TILE=_TILE,
        PLANES=planes,
    )


def gather_blocks(
    kv: torch.Tensor,
    block_ids: torch.Tensor | list[int],
    layers: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy blocks `block_ids` of layers [l0, l1) into a contiguous [l1-l0, planes, n, ...]
    buffer."""
    l0, l1 = layer_range(kv, layers)
    ids = as_block_ids(block_ids, kv.device)
    out = gather_buffer(kv, ids, l0, l1, out)
    positions = torch.arange(ids.numel(), dtype=torch.int64, device=kv.device)
    _launch(kv[l0:l1], ids, out, positions)
    return out


def scatter_blocks(
    kv: torch.Tensor,
    buffer: torch.Tensor,
    block_ids: torch.Tensor | list[int],
    layers: tuple[int, int] | None = None,
) -> None:
    """Write a [l1-l0, planes, n, ...] buffer into blocks `block_ids` of layers [l0, l1) of
    `kv`."""
    l0, l1 = layer_range(kv, layers)
    ids = as_block_ids(block_ids, kv.device)
    check_scatter_buffer(kv, buffer, ids, l0, l1)
    positions = torch.arange(ids.numel(), dtype=torch.int64, device=kv.device)
    _launch(buffer, positions, kv[l0:l1], ids)


def copy_blocks(
    src_kv: torch.Tensor,
    src_ids: torch.Tensor | list[int],
    dst_kv: torch.Tensor,
    dst_ids: torch.Tensor | list[int],
    layers: tuple[int, int] | None = None,
) -> None:
    """Copy blocks src_ids of src_kv into blocks dst_ids of dst_kv in one pass (dst_kv may be
    another process's pool mapped through CUDA IPC)."""
    check_pools(src_kv, dst_kv)
    l0, l1 = layer_range(src_kv, layers)
    s_ids = as_block_ids(src_ids, src_kv.device)
    d_ids = as_block_ids(dst_ids, src_kv.device)
    if s_ids.numel() != d_ids.numel():
        raise ValueError(f"{s_ids.numel()} source blocks but {d_ids.numel()} destination blocks")
    _launch(src_kv[l0:l1], s_ids, dst_kv[l0:l1], d_ids)
