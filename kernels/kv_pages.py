"""Torch reference for moving KV pages: gather blocks into a contiguous buffer, scatter them back.

A pool is [num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim] (planes: 2 for K
and V, 1 for multi-head latent attention's latent); a buffer of n blocks is [l1 - l0, planes, n,
block_size, num_kv_heads, head_dim]. Every function moves bits, never converts.
"""

from __future__ import annotations

import numpy as np
import torch

# The direct copy moves rows through a scratch buffer this big, so it stays in cache.
_COPY_CHUNK_BYTES = 2 << 20
# Runs of at least this many consecutive blocks (on both sides) are copied as one slice.
_MIN_RUN = 8


def as_block_ids(block_ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an int64 tensor on the pool's device."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.int64)
    return torch.tensor(block_ids, dtype=torch.int64, device=device)


def layer_range(kv: torch.Tensor, layers: tuple[int, int] | None) -> tuple[int, int]:
    """The (l0, l1) a call covers, checked against the pool's layer count."""
    l0, l1 = (0, kv.shape[0]) if layers is None else (int(layers[0]), int(layers[1]))
    if not 0 <= l0 < l1 <= kv.shape[0]:
        raise ValueError(f"layer range {(l0, l1)} outside [0, {kv.shape[0]}]")
    return l0, l1


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View [L, P, N, *block] as [L * P * N, block_numel] rows (one row = one page of a plane)."""
    return t.view(t.shape[0] * t.shape[1] * t.shape[2], -1)


def _row_ids(ids: torch.Tensor, num_rows: int, num_blocks: int) -> torch.Tensor:
    """Row index of block ids[i] in page row r, for every r: [num_rows * n]."""
    base = torch.arange(num_rows, dtype=torch.int64, device=ids.device) * num_blocks
    return (base[:, None] + ids[None, :]).reshape(-1)


def _np_rows(rows: torch.Tensor):
    """A numpy view of [R, E] rows with one opaque element per row.

    Numpy moves such rows with one memcpy each, on the calling thread. Torch's index_select /
    index_copy_ on CPU run at a half to a tenth of that: index_copy_ copies element-wise, and
    index_select spreads over the OpenMP pool, which crawls when the cores are busy (as they
    are with a model running next to the transfer thread). Numpy has no bfloat16 either.
    """
    row_bytes = rows.shape[1] * rows.element_size()
    return rows.view(torch.uint8).numpy().view(np.dtype((np.void, row_bytes))).reshape(-1)


def gather_buffer(
    kv: torch.Tensor, ids: torch.Tensor, l0: int, l1: int, out: torch.Tensor | None
) -> torch.Tensor:
    """The [l1-l0, planes, n, ...] buffer a gather fills: `out` once checked, or a new one."""
    shape = (l1 - l0, kv.shape[1], ids.numel(), *kv.shape[3:])
    if out is None:
        return torch.empty(shape, dtype=kv.dtype, device=kv.device)
    if tuple(out.shape) != shape or out.dtype != kv.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} {kv.dtype} tensor")
    return out


def check_scatter_buffer(
    kv: torch.Tensor, buffer: torch.Tensor, ids: torch.Tensor, l0: int, l1: int
) -> None:
    shape = (l1 - l0, kv.shape[1], ids.numel(), *kv.shape[3:])
    if tuple(buffer.shape) != shape or buffer.dtype != kv.dtype:
        raise ValueError(f"buffer {tuple(buffer.shape)} {buffer.dtype} is not {shape} {kv.dtype}")


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
    src = kv[l0:l1]
    row_ids = _row_ids(ids, (l1 - l0) * kv.shape[1], kv.shape[2])
    if kv.device.type == "cpu":
        # mode="clip": ids are checked by the caller; the default "raise" buffers a copy.
        np.take(_np_rows(_rows(src)), row_ids.numpy(), out=_np_rows(_rows(out)), mode="clip")
    else:
        torch.index_select(_rows(src), 0, row_ids, out=_rows(out))
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
    if ids.numel() == 0:
        return
    dst = _rows(kv[l0:l1])
    row_ids = _row_ids(ids, (l1 - l0) * kv.shape[1], kv.shape[2])
    src = _rows(buffer.contiguous())
    if kv.device.type == "cpu":
        _np_rows(dst)[row_ids.numpy()] = _np_rows(src)
    else:
        dst.index_copy_(0, row_ids, src)


def write_pages(
    pages: torch.Tensor, block_ids: torch.Tensor | list[int], data: torch.Tensor
) -> None:
    """Write data [n, *page] into blocks block_ids of one plane of one layer's pages [N, *page]
    (its K, its V, or MLA's latent)."""
    ids = as_block_ids(block_ids, pages.device)
    if tuple(data.shape) != (ids.numel(), *pages.shape[1:]) or data.dtype != pages.dtype:
        raise ValueError(f"data {tuple(data.shape)} {data.dtype} does not fit {ids.numel()} pages")
    rows, src = pages.view(pages.shape[0], -1), data.contiguous().view(ids.numel(), -1)
    if pages.device.type == "cpu":
        _np_rows(rows)[ids.numpy()] = _np_rows(src)
    else:
        rows.index_copy_(0, ids, src)


def check_pools(src_kv: torch.Tensor, dst_kv: torch.Tensor) -> None:
    """Two pools blocks are copied between: alike in all but their block counts."""
    if src_kv.shape[:2] != dst_kv.shape[:2] or src_kv.shape[3:] != dst_kv.shape[3:]:
        raise ValueError(f"pools differ: {tuple(src_kv.shape)} vs {tuple(dst_kv.shape)}")
    if src_kv.dtype != dst_kv.dtype:
        raise ValueError(f"pools differ in dtype: {src_kv.dtype} vs {dst_kv.dtype}")


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Split a block mapping into (src_start, dst_start, length) runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(
    src_kv: torch.Tensor,
    src_ids: torch.Tensor | list[int],
    dst_kv: torch.Tensor,
    dst_ids: torch.Tensor | list[int],
    layers: tuple[int, int] | None = None,
) -> None:
    """Copy blocks src_ids of src_kv into blocks dst_ids of dst_kv (another pool, same layout).

    Long runs of consecutive blocks are copied as slices (memcpy speed); scattered blocks go
    through a small scratch buffer a few rows at a time, so each byte crosses main memory about
    once, not three times as a whole-range gather then scatter would.
    """
    check_pools(src_kv, dst_kv)
    l0, l1 = layer_range(src_kv, layers)
    s_list = src_ids.tolist() if isinstance(src_ids, torch.Tensor) else list(src_ids)
    d_list = dst_ids.tolist() if isinstance(dst_ids, torch.Tensor) else list(dst_ids)
    if len(s_list) != len(d_list):
        raise ValueError(f"{len(s_list)} source blocks but {len(d_list)} destination blocks")
    if not s_list:
        return
    planes = src_kv.shape[1]
    src = src_kv[l0:l1].view((l1 - l0) * planes, src_kv.shape[2], -1)
    dst = dst_kv[l0:l1].view((l1 - l0) * planes, dst_kv.shape[2], -1)
    runs = block_runs(s_list, d_list)
    if len(runs) * _MIN_RUN <= len(s_list):
        for s, d, n in runs:
            if dst_kv.device.type == "cpu":  # one memcpy per page row run, on this thread
                for r in range(dst.shape[0]):
                    np.copyto(_np_rows(dst[r, d : d + n]), _np_rows(src[r, s : s + n]))
            else:
                dst[:, d : d + n].copy_(src[:, s : s + n])
        return
    num_rows = src.shape[0]
    s_rows = _row_ids(as_block_ids(s_list, src_kv.device), num_rows, src_kv.shape[2])
    d_rows = _row_ids(as_block_ids(d_list, dst_kv.device), num_rows, dst_kv.shape[2])
    src_flat, dst_flat = src.view(-1, src.shape[2]), dst.view(-1, dst.shape[2])
    if dst_kv.device.type != "cpu":
        dst_flat.index_copy_(0, d_rows, src_flat.index_select(0, s_rows).to(dst_kv.device))
        return
    per_chunk = max(1, _COPY_CHUNK_BYTES // (src.shape[2] * src.element_size()))
    scratch = _np_rows(torch.empty((min(per_chunk, len(s_rows)), src.shape[2]), dtype=src.dtype))
    src_np, dst_np = _np_rows(src_flat), _np_rows(dst_flat)
    s_np, d_np = s_rows.numpy(), d_rows.numpy()
    for i in range(0, len(s_np), per_chunk):
        k = min(per_chunk, len(s_np) - i)
        np.take(src_np, s_np[i : i + k], out=scratch[:k], mode="clip")
        dst_np[d_np[i : i + k]] = scratch[:k]
