"""KV integrity: a digest of the pages a send moves, computed by the sender from its pool and by
the receiver from its own pool once the pages have landed, so that a page corrupted anywhere on
the way (in a transport, a staging buffer, a scatter into the wrong block) fails the transfer
before the sequence runs on it.

A digest covers a run of pages in one order, the order a chunk's gathered buffer holds them:
layer by layer, plane by plane (K then V, or the latent), block by block in the send's order,
only the KV heads the send moves. Both sides compute it over that byte sequence:

- `xxh3_64` (the xxhash library) on CPU pools, streamed over contiguous runs of the pool with no
  copy (on one core of the CI machine about 110 GB/s from cache and 33 GB/s from memory, beside
  an 18 GB/s memcpy); where a send lies in a few runs of blocks, each piece is hashed as it is
  gathered, copied or written into the pool, while it is in cache (`gather_and_digest`,
  `copy_and_digest`, `scatter_and_digest`);
- `sum64` on CUDA pools, a torch reduction on the device: the 32-bit words w_i of the bytes
  summed as w_i * (i + 1) in wrapping 64-bit integers, so a changed or moved word changes it.

The sender names its algorithm in its Hello; the receiver computes the one named, on its own
device (a CUDA receiver of a CPU sender's `xxh3_64` hashes a host copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from pdserve.kernels import kv_pages
from pdserve.kv_transfer.pages import source_runs

XXH3 = "xxh3_64"
SUM64 = "sum64"
ALGORITHMS = (XXH3, SUM64)
_SUM64_COLUMNS = 1024


class IntegrityError(RuntimeError):
    """A send's pages landed other than they left."""


def algorithm_for(kv: torch.Tensor) -> str:
    """The digest a pool on this device computes best."""
    return XXH3 if kv.device.type == "cpu" else SUM64


def digest_buffer(buffer: torch.Tensor, algorithm: str) -> int:
    """The digest of a contiguous tensor's bytes (a gathered chunk, a received frame)."""
    if algorithm == XXH3:
        return xxhash.xxh3_64_intdigest(_bytes(buffer.cpu()))
    if algorithm == SUM64:
        return _sum64(buffer)
    raise ValueError(f"unknown KV digest {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def digest_frames(frames: Sequence[np.ndarray], algorithm: str) -> int:
    """The digest of the frames' bytes one after another, as if they were one buffer: XXH3, the
    digest of the CPU pools that send frames straight from the pool."""
    if algorithm != XXH3:
        raise ValueError(f"frames are digested with {XXH3}, not {algorithm!r}")
    hasher = xxhash.xxh3_64()
    for frame in frames:
        hasher.update(frame)
    return hasher.intdigest()


def digest_pages(
    kv: torch.Tensor,
    block_ids: Sequence[int],
    layers: tuple[int, int],
    heads: tuple[int, int] | None,
    algorithm: str,
) -> int:
    """The digest of blocks `block_ids` (in that order) of layers [l0, l1) of a pool, only KV
    heads `heads` of each page: what a gather of them would hold."""
    whole = heads is None or (heads[0] == 0 and heads[1] == kv.shape[4])
    if algorithm == XXH3 and kv.device.type == "cpu" and whole:
        hasher = xxhash.xxh3_64()
        runs = source_runs(list(block_ids))
        pages = _page_rows(kv)
        for layer in range(*layers):
            for plane in range(kv.shape[1]):
                rows = pages[layer, plane]
                for start, n in runs:
                    hasher.update(rows[start : start + n])
        return hasher.intdigest()
    ids = kv_pages.as_block_ids(list(block_ids), kv.device)
    h0, h1 = (0, kv.shape[4]) if heads is None else heads
    data = torch.index_select(kv[layers[0] : layers[1], :, :, :, h0:h1], 2, ids)
    return digest_buffer(data.contiguous(), algorithm)


# A copy, gather or scatter of at most this many runs of consecutive blocks hashes as it goes
# (one numpy copy and one hash update per run, layer and plane); more go through the kernels'
# vectorised copy, then a hash of the result.
MAX_FUSED_RUNS = 64


def copy_and_digest(
    src_kv: torch.Tensor,
    src_ids: Sequence[int],
    dst_kv: torch.Tensor,
    dst_ids: Sequence[int],
    layers: tuple[int, int],
) -> int | None:
    """Copy whole pages between two CPU pools in a few long runs, hashing each piece of the
    source (XXH3) right after copying it, while it is still in cache: the digest of the source
    pages, for about the cost of the copy alone. None (nothing copied) where the pools or the
    block lists do not suit: the caller copies and hashes apart."""
    if src_kv.device.type != "cpu" or dst_kv.device.type != "cpu":
        return None
    runs = kv_pages.block_runs(list(src_ids), list(dst_ids))
    if len(runs) > MAX_FUSED_RUNS:
        return None
    kv_pages.check_pools(src_kv, dst_kv)
    hasher = xxhash.xxh3_64()
    src_pages, dst_pages = _page_rows(src_kv), _page_rows(dst_kv)
    for layer in range(*layers):
        for plane in range(src_kv.shape[1]):
            src, dst = src_pages[layer, plane], dst_pages[layer, plane]
            for s, d, n in runs:
                piece = src[s : s + n]
                np.copyto(dst[d : d + n], piece)
                hasher.update(piece)
    return hasher.intdigest()


def gather_and_digest(
    kv: torch.Tensor, ids: Sequence[int], layers: tuple[int, int], out: torch.Tensor
) -> int | None:
    """Gather whole pages of a CPU pool into `out` ([layers, planes, n, ...], contiguous),
    hashing each piece right after copying it: the digest a chunk carries, for about the cost
    of the gather. None (nothing gathered) where the pages lie in too many runs."""
    runs = source_runs(list(ids))
    if kv.device.type != "cpu" or len(runs) > MAX_FUSED_RUNS:
        return None
    hasher = xxhash.xxh3_64()
    pages, gathered = _page_rows(kv), _page_rows(out)
    for i, layer in enumerate(range(*layers)):
        for plane in range(kv.shape[1]):
            at = 0
            for start, n in runs:
                piece = gathered[i, plane, at : at + n]
                np.copyto(piece, pages[layer, plane, start : start + n])
                hasher.update(piece)
                at += n
    return hasher.intdigest()


def scatter_and_digest(
    kv: torch.Tensor, data: torch.Tensor, ids: Sequence[int], layers: tuple[int, int]
) -> int | None:
    """Write a gathered chunk `data` ([layers, planes, n, ...]) into whole pages of blocks
    `ids` of a CPU pool, hashing each landed piece from the pool right after writing it: the
    landed pages' digest, for about the cost of the write. None (nothing written) where the
    blocks lie in too many runs."""
    runs = source_runs(list(ids))
    if kv.device.type != "cpu" or data.device.type != "cpu" or len(runs) > MAX_FUSED_RUNS:
        return None
    hasher = xxhash.xxh3_64()
    pages, chunk = _page_rows(kv), _page_rows(data.contiguous())
    for i, layer in enumerate(range(*layers)):
        for plane in range(kv.shape[1]):
            at = 0
            for start, n in runs:
                landed = pages[layer, plane, start : start + n]
                np.copyto(landed, chunk[i, plane, at : at + n])
                hasher.update(landed)
                at += n
    return hasher.intdigest()


def _page_rows(kv: torch.Tensor) -> np.ndarray:
    """A CPU pool as numpy [layers, planes, blocks, page bytes]: slicing it costs far less
    than slicing the tensor, which matters for sends of scattered blocks (a page at a time)."""
    return kv.view(torch.uint8).numpy().reshape(kv.shape[0], kv.shape[1], kv.shape[2], -1)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes, as numpy sees them (no copy)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _sum64(buffer: torch.Tensor) -> int:
    raw = buffer.contiguous().view(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    n = words.numel()
    pad = -n % _SUM64_COLUMNS
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    grid = words.view(-1, _SUM64_COLUMNS)
    # sum_i w_i (i + 1) with i = r * C + c: C * sum_r r * row_r + sum_c (c + 1) * col_c
    rows = grid.sum(1, dtype=torch.int64)
    cols = grid.sum(0, dtype=torch.int64)
    r = torch.arange(grid.shape[0], dtype=torch.int64, device=grid.device)
    c = torch.arange(1, _SUM64_COLUMNS + 1, dtype=torch.int64, device=grid.device)
    total = (rows * r).sum() * _SUM64_COLUMNS + (cols * c).sum()
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF
