"""Landing a send's pages in the receiver's pool: scattering each pushed chunk into its blocks and
checking what landed (a chunk's header against the pool, the sender's digest against the pages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.cluster.codec import ProtocolError
from pdserve.engine.kv.cache import KVPool
from pdserve.kv_transfer import pages
from pdserve.kv_transfer.arrivals import Unit
from pdserve.kv_transfer.faults import KVFaults
from pdserve.kv_transfer.integrity import XXH3, IntegrityError, digest_pages, scatter_and_digest
from pdserve.kv_transfer.protocol import Pages


class Payload:
    """The bytes of one pushed chunk (one buffer, or one per (layer, plane, run) when the header
    has runs), ready now (tcp) or once a device transfer ends (nccl)."""

    def __init__(self, parts: list[torch.Tensor], event: Any = None) -> None:
        self.parts = parts
        self.event = event

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class PageLanding:
    """Writes chunks of pages into a pool and verifies them; `algorithm` is the digest the
    sending peer announced (None: it sends none, nothing is checked). Sockets and transfers are
    the receiver's; a transport says how its bytes reach the pool's device (`to_device`), and
    pages land on `stream` where the pool has one."""

    def __init__(
        self,
        pool: KVPool,
        stream: torch.cuda.Stream | None,
        faults: KVFaults | None,
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.pool = pool
        self.layout = pool.layout
        self.stream = stream
        self.faults = faults  # None unless PDSERVE_KV_FAULTS asks for some
        self.to_device = to_device

    def check_chunk(self, msg: Pages) -> None:
        """A chunk's header must describe pages of this pool: its payload is sized from it."""
        if msg.layers[1] > self.layout.num_slots or msg.hi > self.pool.num_blocks:
            raise ProtocolError(
                f"pages chunk of layers {list(msg.layers)} x blocks [{msg.lo}, {msg.hi}) is "
                f"outside a pool of {self.layout.num_slots} layers x {self.pool.num_blocks}"
            )
        if msg.heads is not None and msg.heads[1] > self.layout.num_kv_heads:
            raise ProtocolError(
                f"pages of heads {list(msg.heads)} for a pool of {self.layout.num_kv_heads}"
            )
        nbytes = pages.Chunk(msg.layers, msg.lo, msg.hi).nbytes(
            pages.sliced(self.layout, msg.heads)
        )
        if msg.nbytes != nbytes:
            raise ProtocolError(f"pages chunk says {msg.nbytes} bytes, its pages are {nbytes}")
        if msg.runs is not None and sum(msg.runs) != msg.hi - msg.lo:
            raise ProtocolError(f"runs {msg.runs[:8]} do not cover blocks [{msg.lo}, {msg.hi})")

    def land(self, unit: Unit, msg: Pages, payload: Payload, algorithm: str | None) -> None:
        """Land a chunk of the unit's pages and verify them (raises IntegrityError), counting
        them in `unit.pages`; after a send's last chunk, the pages are in before this returns."""
        kv, dtype, layers = self.pool.kv, self.layout.torch_dtype, tuple(msg.layers)
        dst = unit.dst_blocks[msg.lo : msg.hi]
        if self.faults is not None:
            self.faults.in_flight(payload.parts)
        fuse = algorithm == XXH3
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                landed = self._write(kv, dtype, layers, dst, msg, payload, fuse)
                self.verify(unit, dst, layers, msg.digest, algorithm, landed)
        else:
            landed = self._write(kv, dtype, layers, dst, msg, payload, fuse)
            self.verify(unit, dst, layers, msg.digest, algorithm, landed)
        unit.pages += (layers[1] - layers[0]) * (msg.hi - msg.lo)
        if msg.last:
            self.synchronize()  # the pages are in before anyone hears so

    def synchronize(self) -> None:
        """Wait for every landing queued on the device."""
        if self.stream is not None:
            self.stream.synchronize()

    def _write(
        self, kv, dtype, layers, dst: list[int], msg: Pages, payload: Payload, fuse: bool
    ) -> int | None:
        """Land a chunk's pages; with `fuse` (a sender that digests with XXH3), return their
        digest where the write computed it on the way (a CPU pool's whole pages in a few
        runs), else None."""
        ids = torch.tensor(dst, dtype=torch.int64, device=kv.device)
        layout = pages.sliced(self.layout, msg.heads)
        heads = None if msg.heads is None else tuple(msg.heads)
        if msg.runs is None:
            shape = pages.Chunk(layers, msg.lo, msg.hi).shape(layout)
            data = payload.parts[0].view(dtype).view(shape)
            if fuse and heads is None:
                landed = scatter_and_digest(kv, data, dst, layers)
                if landed is not None:
                    return landed
            pages.scatter(kv, self.to_device(data), ids, layers, heads)
            return None
        parts = iter(payload.parts)
        page = (layout.block_size, layout.num_kv_heads, layout.page_width)
        for layer in range(*layers):
            for plane in range(layout.planes):
                start = 0
                for length in msg.runs:
                    data = self.to_device(next(parts).view(dtype).view(length, *page))
                    pages.write(kv, layer, plane, ids[start : start + length], data, heads)
                    start += length

    def check_written(
        self,
        unit: Unit,
        dst: list[int],
        layers: tuple[int, int],
        digest: int | None,
        algorithm: str | None,
    ) -> None:
        """Verify pages a sender wrote into the pool itself (a direct write)."""
        if self.faults is not None:
            heads = None if unit.heads is None else tuple(unit.heads)
            self.faults.after_landing(self.pool.kv, dst, tuple(layers), heads)
        self.verify(unit, dst, layers, digest, algorithm)

    def verify(
        self,
        unit: Unit,
        dst: list[int],
        layers: tuple[int, int],
        digest: int | None,
        algorithm: str | None,
        landed: int | None = None,
    ) -> None:
        """Raise IntegrityError unless the landed pages have the digest their sender sent (a
        sender that announced digests must send one with every chunk and write). landed: their
        digest, where the write computed it from the pool as it wrote (else read here)."""
        if algorithm is None:
            return
        if digest is None:
            raise IntegrityError(f"pages of {unit.transfer_id!r} came without their digest")
        if landed is None:
            heads = None if unit.heads is None else tuple(unit.heads)
            landed = digest_pages(self.pool.kv, dst, tuple(layers), heads, algorithm)
        if landed != digest:
            raise IntegrityError(
                f"KV integrity check failed: pages of {unit.transfer_id!r} (layers "
                f"{list(layers)}, {len(dst)} blocks) landed with {algorithm} {landed:#018x}, "
                f"sent with {digest:#018x}"
            )
