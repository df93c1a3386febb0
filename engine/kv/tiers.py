"""The KV tiers under one engine's device pool: host memory, and local disk under it.

Every full block the prefix cache registers is copied once to the host tier (write-through), and
from there to the disk tier, by threads of their own: the step loop only submits copies and
collects the finished ones at its next step. While a block is being copied its device block is
held (never evicted or rewritten) and its host slot is pinned (never evicted); a tier serves a
block only once its copy completed. Eviction from the device pool then costs nothing: the block
is below it already.

Every KV group's blocks go down alike, each under its group's key (`cluster.block_hash.group_hash`:
group 0's the chained hash the coordinator's prefix index knows, the others' salted, so no
prompt's chain of hashes names them). A waiting request whose prompt continues past its
device-cached prefix has the longest prefix for which every group holds, in the pool or below
it, what the next query reads (`KVCacheManager.find_below`: a full group every block, a windowed
one the window's) allocated and the blocks the pool lacks loaded back (`find` then `load`); it
leaves the scheduler's queue meanwhile and returns to its head once the load ended (`poll`), so
the step loop never waits for a load. A block that fails to load (a disk file gone or corrupt)
and every block after it are computed instead, giving the same tokens.

On a GPU the copies run on a side stream of their own, after the steps that wrote the blocks
(an event recorded on the compute stream when the copy is submitted), into and out of pinned
host memory.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.kv.block_manager import BlockKey, BlockManager
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.kv.disk_tier import DiskBlockError, DiskTier, read_block, write_block
from pdserve.engine.kv.host_tier import HostTier
from pdserve.engine.kv.kv_manager import KVCacheManager, PrefixLoad
from pdserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)

LOWER_TIERS = ("host", "disk")
# Blocks on their way to disk at most: past it (a disk slower than the blocks coming), blocks
# stay in the host tier alone.
MAX_DISK_WRITES = 1024


@dataclass(slots=True)
class TierStats:
    """Since the engine started, per lower tier."""

    hit_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIERS, 0))
    miss_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIERS, 0))
    written_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIERS, 0))
    loaded_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOWER_TIERS, 0))
    loads: int = 0  # loads that ended (requests whose blocks came back)
    load_seconds: float = 0.0  # their time from submission to the step that saw them end
    failures: int = 0  # block copies or reads that failed (the block is computed instead)
    skipped_stores: int = 0  # blocks not copied to a full tier whose slots were all in use


@dataclass(slots=True)
class TierHit:
    block_hash: int
    key: BlockKey
    tier: str  # "host" or "disk"
    slot: int | None = None  # the host slot, for a host hit


@dataclass(slots=True)
class TierLoad:
    """A prompt's prefix past its device-cached one (`prefix`), and where below the pool each
    block it loads is (`hits`, one per `prefix.places`, pinned until the load ends)."""

    prefix: PrefixLoad
    hits: list[TierHit]


@dataclass(slots=True)
class _Load:
    on_end: Callable[[int], None]  # called with how many of `blocks` were filled
    blocks: list[int]  # device blocks being filled, one per hit
    hits: list[TierHit]
    future: Future
    started: float


@dataclass(slots=True)
class _Store:
    entries: list[tuple[int, int, int, BlockKey]]  # (device block, host slot, hash, key)
    to_disk: list[bool]  # which entries go on to the disk tier
    future: Future  # its result: a copy of those entries' pages, in order


@dataclass(slots=True)
class _DiskWrite:
    block_hash: int
    key: BlockKey
    future: Future


class KVTiers:
    def __init__(
        self,
        pool: KVPool,
        block_manager: BlockManager,
        host: HostTier,
        disk: DiskTier | None = None,
    ) -> None:
        self.pool = pool
        self.block_manager = block_manager
        self.host = host
        self.disk = disk
        self.stats = TierStats()
        self.block_bytes = pool.layout.bytes_per_block
        block_manager.newly_cached = []
        self._device = pool.kv.device
        self._cuda = pool.kv.is_cuda
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-host")
        self._disk_io = (
            ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-disk") if disk else None
        )
        self._loads: list[_Load] = []
        self._stores: list[_Store] = []
        self._disk_writes: list[_DiskWrite] = []
        self._logged_failure = False

    @property
    def busy(self) -> bool:
        """Copies in flight (the step loop goes on stepping until they are collected)."""
        return bool(self._loads or self._stores or self._disk_writes)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a copy in flight ends or timeout_s passed (an idle loop's pause)."""
        futures = [j.future for j in (*self._loads, *self._stores, *self._disk_writes)]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # --- writing down ------------------------------------------------------------------------

    def store_new(self) -> None:
        """Copy the blocks registered since the last call down, one copy job for all of them:
        to a host slot where the host tier has none of them and a slot to spare, and to disk
        (from a copy of their own, so that the disk's pace never holds host slots) where the
        disk tier has none of them."""
        bm = self.block_manager
        newly, bm.newly_cached = bm.newly_cached, []
        entries: list[tuple[int, int | None, int, BlockKey]] = []
        to_disk: list[bool] = []
        room = MAX_DISK_WRITES - len(self._disk_writes)
        for block, block_hash in newly:
            if bm.registered_hash(block) != block_hash:
                continue  # evicted and reused before this step
            slot = None
            if not self.host.holds(block_hash):
                slot = self.host.reserve(block_hash)
                if slot is None:
                    self.stats.skipped_stores += 1
            down = self.disk is not None and not self.disk.holds(block_hash) and room > 0
            if slot is None and not down:
                continue
            room -= down
            bm.hold([block])  # never evicted nor rewritten while it is read
            entries.append((block, slot, block_hash, bm.key(block)))
            to_disk.append(down)
        if entries:
            ready = self._ready_event()
            pairs = [(block, slot) for block, slot, _, _ in entries]
            future = self._copier.submit(self._to_host, pairs, ready, to_disk)
            self._stores.append(_Store(entries, to_disk, future))

    def _write_down(self, pages: torch.Tensor, block_hash: int, key: BlockKey) -> None:
        """Write a block just copied down (a host copy of its pages, its own) to disk."""
        if self.disk.holds(block_hash):
            return
        evicted = self.disk.reserve(block_hash)
        if evicted is None:
            self.stats.skipped_stores += 1
            return
        future = self._disk_io.submit(self._to_disk, evicted, block_hash, key, pages)
        self._disk_writes.append(_DiskWrite(block_hash, key, future))

    # --- loading back ------------------------------------------------------------------------

    def find(self, kv: KVCacheManager, seq: Sequence, num_tokens: int) -> TierLoad:
        """The longest prefix of seq's first num_tokens tokens (the last left to compute) that
        the lower tiers complete past its device-cached one (seq's tables, from
        allocate_prefix), for every KV group; the host slots and disk files of the blocks it
        loads are pinned until `load` ends, or `release`."""
        prefix = kv.find_below(seq, num_tokens, self.serves)
        return TierLoad(prefix, [self.hit(block_hash, key) for block_hash, key in prefix.keys])

    def serves(self, block_hash: int, key: BlockKey) -> bool:
        """Whether a lower tier serves this block now (its recency unchanged)."""
        return self.host.serves(block_hash, key) or (
            self.disk is not None and self.disk.serves(block_hash, key)
        )

    def hit(self, block_hash: int, key: BlockKey) -> TierHit | None:
        """This block in the fastest tier serving it, pinned (now its most recently used), or
        None."""
        slot = self.host.lookup(block_hash, key)
        if slot is not None:
            self.host.pin(slot)
            return TierHit(block_hash, key, "host", slot)
        if self.disk is not None and self.disk.lookup(block_hash, key):
            self.disk.pin(block_hash)
            return TierHit(block_hash, key, "disk")
        return None

    def count_lookup(self, found: TierLoad) -> None:
        """Count a lookup's hits and misses per tier (once it is final: loading, or nothing to
        load). A block every group computes after the hit is a miss of every tier; a block
        loaded from disk a miss of the host tier too."""
        prefix = found.prefix
        computed = prefix.num_groups * (prefix.max_blocks - prefix.num_blocks)
        on_host = sum(h.tier == "host" for h in found.hits)
        on_disk = len(found.hits) - on_host
        self.stats.hit_blocks["host"] += on_host
        self.stats.miss_blocks["host"] += computed + on_disk
        if self.disk is not None:
            self.stats.hit_blocks["disk"] += on_disk
            self.stats.miss_blocks["disk"] += computed

    def release(self, hits: list[TierHit]) -> None:
        """Unpin what `find` pinned, for hits that will not be loaded."""
        for hit in hits:
            if hit.tier == "host":
                self.host.unpin(hit.slot)
            else:
                self.disk.unpin(hit.block_hash)

    def load(self, blocks: list[int], hits: list[TierHit], on_end: Callable[[int], None]) -> None:
        """Fill `blocks` (allocated, one per hit) from the tiers; `poll` calls on_end(n) once
        the load ended, its first n blocks filled (the rest must be computed)."""
        ready = self._ready_event()
        if any(h.tier == "disk" for h in hits):
            future = self._disk_io.submit(self._from_tiers, blocks, hits, ready)
        else:
            future = self._copier.submit(self._from_tiers, blocks, hits, ready)
        self._loads.append(_Load(on_end, blocks, hits, future, time.monotonic()))

    # --- collecting what ended ---------------------------------------------------------------

    def poll(self) -> None:
        """Collect every copy that ended: stores enter the host tier (and go on to disk), disk
        writes enter the disk tier, and each ended load's on_end is called."""
        self._collect_stores()
        self._collect_disk_writes()
        done, self._loads = _split_ended(self._loads)
        ended = []
        for job in done:
            self.release(job.hits)
            exc = job.future.exception()
            loaded, error = job.future.result() if exc is None else (0, repr(exc))
            if error is not None:
                self._failed(f"KV tier load: {error}")
                failed = job.hits[loaded]
                if failed.tier == "disk":
                    self._delete(self.disk.drop(failed.block_hash))
            for hit in job.hits[:loaded]:
                self.stats.loaded_bytes[hit.tier] += self.block_bytes
            self.stats.loads += 1
            self.stats.load_seconds += time.monotonic() - job.started
            ended.append((job.on_end, loaded))
        for on_end, loaded in ended:
            on_end(loaded)

    def _collect_stores(self) -> None:
        done, self._stores = _split_ended(self._stores)
        for job in done:
            error = job.future.exception()
            self.block_manager.free([block for block, _, _, _ in job.entries])
            copies = iter(job.future.result() if error is None else ())
            for (_, slot, block_hash, key), to_disk in zip(job.entries, job.to_disk):
                if slot is not None and error is not None:
                    self.host.abandon(block_hash)
                    continue
                if slot is not None:
                    self.host.commit(block_hash, key)
                    self.stats.written_bytes["host"] += self.block_bytes
                if to_disk and error is None:
                    self._write_down(next(copies), block_hash, key)
            if error is not None:
                self._failed(f"KV host tier copy: {error!r}", len(job.entries))

    def _collect_disk_writes(self) -> None:
        done, self._disk_writes = _split_ended(self._disk_writes)
        for job in done:
            error = job.future.exception()
            if error is None:
                self.disk.commit(job.block_hash, job.key)
                self.stats.written_bytes["disk"] += self.block_bytes
            else:
                self.disk.abandon(job.block_hash)
                self._failed(f"KV disk tier write: {error!r}")

    def _failed(self, why: str, count: int = 1) -> None:
        self.stats.failures += count
        if not self._logged_failure:  # once: a failing disk would flood the log
            logger.warning("%s; the blocks are computed instead (logged once)", why)
            self._logged_failure = True

    def _delete(self, path: str | None) -> None:
        if path is not None:
            self._disk_io.submit(_remove, [path])

    def set_events(self, events: Any) -> None:
        """Log blocks entering and leaving the lower tiers there (a node's KV events)."""
        self.host.events = events
        if self.disk is not None:
            self.disk.events = events

    def num_blocks(self) -> dict[str, int]:
        """Blocks each lower tier serves now."""
        held = {"host": self.host.num_blocks}
        if self.disk is not None:
            held["disk"] = self.disk.num_blocks
        return held

    def hashes(self) -> dict[str, list[int]]:
        """Every block each lower tier serves now, by hash."""
        held = {"host": self.host.hashes()}
        if self.disk is not None:
            held["disk"] = self.disk.hashes()
        return held

    def close(self) -> None:
        """Wait for the copies in flight, stop the threads, and remove the disk tier's files."""
        self._copier.shutdown(wait=True)
        if self._disk_io is not None:
            self._disk_io.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    # --- the copies (on the tiers' threads) ----------------------------------------------------

    def _ready_event(self) -> Any:
        """On a GPU: an event after the work queued so far on the compute stream, which the
        copy waits for (the steps that wrote, or last read, the blocks)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: Any) -> None:
        """dst.copy_(src) for each pair, done when this returns."""
        if not self._cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        torch.cuda.set_device(self._device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def _to_host(
        self, pairs: list[tuple[int, int | None]], ready: Any, to_disk: list[bool]
    ) -> list[torch.Tensor]:
        """Copy blocks to their host slots (those given one); returns a host copy of each
        block going on to disk."""
        kv, buffer = self.pool.kv, self.host.buffer
        copies = [
            buffer[slot] if slot is not None else torch.empty_like(buffer[0], pin_memory=self._cuda)
            for (_, slot), down in zip(pairs, to_disk)
            if slot is not None or down
        ]
        self._copy([(dst, kv[:, :, block]) for dst, (block, _) in zip(copies, pairs)], ready)
        return [
            dst.clone() if slot is not None else dst
            for dst, (_, slot), down in zip(copies, pairs, to_disk)
            if down
        ]

    def _to_disk(
        self, evicted: list[str], block_hash: int, key: BlockKey, pages: torch.Tensor
    ) -> None:
        _remove(evicted)
        write_block(self.disk.file(block_hash), self.pool.layout, key, pages)

    def _from_tiers(
        self, blocks: list[int], hits: list[TierHit], ready: Any
    ) -> tuple[int, str | None]:
        """Fill the blocks in order; (blocks filled, why the next one failed or None)."""
        kv = self.pool.kv
        staging = None
        for i, (block, hit) in enumerate(zip(blocks, hits)):
            if hit.tier == "host":
                self._copy([(kv[:, :, block], self.host.buffer[hit.slot])], ready)
                continue
            if staging is None:
                staging = torch.empty_like(self.host.buffer[0], pin_memory=self._cuda)
            try:
                read_block(self.disk.file(hit.block_hash), self.pool.layout, hit.key, staging)
            except DiskBlockError as exc:
                return i, str(exc)
            self._copy([(kv[:, :, block], staging)], ready)
        return len(blocks), None


def _split_ended(jobs: list) -> tuple[list, list]:
    """(jobs whose copy ended, jobs still in flight), each job's future read once."""
    ended, still = [], []
    for job in jobs:
        (ended if job.future.done() else still).append(job)
    return ended, still


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def tiers_for(config: Any, pool: KVPool, block_manager: BlockManager) -> KVTiers | None:
    """The tiers a node's settings ask for under its pool (None: none)."""
    on_gpu = pool.kv.is_cuda
    host_bytes = host_tier_bytes(config, pool.kv.numel() * pool.kv.element_size(), on_gpu)
    if not host_bytes or not config.enable_prefix_caching or config.tensor_parallel_size > 1:
        return None
    host = HostTier(pool.layout, host_bytes, pin_memory=on_gpu)
    disk = None
    if config.kv_disk_path:
        os.makedirs(config.kv_disk_path, exist_ok=True)
        disk = DiskTier(pool.layout, config.kv_disk_path, disk_tier_bytes(config))
    logger.info(
        "KV tiers: host %d blocks (%.2f GiB)%s",
        host.num_slots,
        host.capacity_bytes / 2**30,
        f", disk {disk.num_slots} blocks ({disk.capacity_bytes / 2**30:.2f} GiB) in "
        f"{disk.directory}"
        if disk
        else "",
    )
    return KVTiers(pool, block_manager, host, disk)


def host_tier_bytes(
    config: Any, pool_bytes: int, on_gpu: bool, host_share: int | None = None
) -> int:
    """The host tier's size: kv_host_bytes, or unset, twice the device pool on a GPU node, at
    most its share of the host's memory (`default_host_share`); on a CPU node (whose pool is
    host memory already: a larger pool serves better) none, or the pool's size under a disk
    tier."""
    if config.kv_host_bytes is not None:
        return config.kv_host_bytes
    if on_gpu:
        share = default_host_share() if host_share is None else host_share
        return min(2 * pool_bytes, share)
    return pool_bytes if config.kv_disk_path else 0


def default_host_share() -> int:
    """What an unset host tier may take on a GPU node: half the host's memory split among its
    GPUs (each GPU's node pins its own; eight nodes of a host must not pin all of it)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return memory // 2 // max(1, torch.cuda.device_count())


def disk_tier_bytes(config: Any) -> int:
    """The disk tier's size: kv_disk_bytes, or unset, 90% of the disk's free space at most
    DEFAULT_DISK_BYTES."""
    if config.kv_disk_bytes is not None:
        return config.kv_disk_bytes
    free = shutil.disk_usage(config.kv_disk_path).free
    return min(DEFAULT_DISK_BYTES, int(free * 0.9))


DEFAULT_DISK_BYTES = 64 << 30
