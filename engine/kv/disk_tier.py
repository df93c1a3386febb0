"""The local-disk KV tier under the host tier: one file per full block, named by its chained hash,
in a directory of its own under `kv_disk_path`, evicted least recently used within a byte budget.

The bookkeeping (`DiskTier`) runs on the node's loop; the file I/O (`write_block`, `read_block`)
on the tiers' disk thread. A file holds a header (the block's key and layout, and the payload's
XXH3-64 digest) and the pages; a read whose key, layout, length or digest differs fails, and the
caller computes the block instead. A file is written under a temporary name and renamed, so a
lookup never finds half a block.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import weakref
from collections import OrderedDict

import torch
import xxhash

from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.events import KVEvents

BlockKey = tuple[int | None, tuple[int, ...]]
MAGIC = b"PDSKV001"


class DiskBlockError(Exception):
    """A block file that cannot be read back as the block it should hold."""


class DiskTier:
    TIER = "disk"

    def __init__(
        self,
        layout: KVLayout,
        path: str,
        capacity_bytes: int,
        events: KVEvents | None = None,
    ) -> None:
        self.layout = layout
        self.block_bytes = layout.bytes_per_block
        self.num_slots = capacity_bytes // self.block_bytes
        if self.num_slots <= 0:
            raise ValueError(
                f"a disk KV tier of {capacity_bytes} bytes holds no block of "
                f"{self.block_bytes} bytes"
            )
        os.makedirs(path, exist_ok=True)
        remove_stale(path)
        # A directory of this process's own: nodes sharing kv_disk_path never see each other's
        # files, and the node's are removed when it closes or its interpreter exits (and, if it
        # was killed, by the next node that starts on the same path).
        self.directory = tempfile.mkdtemp(prefix=f"pdserve-kv-{os.getpid()}-", dir=path)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.events = events
        self._entries: OrderedDict[int, BlockKey] = OrderedDict()  # committed, LRU first
        self._pending: set[int] = set()  # files being written
        self._pins: dict[int, int] = {}  # hash -> reads in flight

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def file(self, block_hash: int) -> str:
        return os.path.join(self.directory, f"{block_hash:032x}.kv")

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._entries or block_hash in self._pending

    def serves(self, block_hash: int, key: BlockKey) -> bool:
        """Whether lookup would find this block, without making it the most recently used."""
        return self._entries.get(block_hash) == key

    def lookup(self, block_hash: int, key: BlockKey) -> bool:
        """Whether a committed file holds this block (now the most recently used)."""
        if self._entries.get(block_hash) != key:
            return False
        self._entries.move_to_end(block_hash)
        return True

    def reserve(self, block_hash: int) -> list[str] | None:
        """Room for a block about to be written: the files to delete first (evicted, least
        recently used, none being read), or None when every file is being written or read."""
        if self.holds(block_hash):
            raise ValueError(f"block {block_hash:032x} is already in the disk tier")
        evicted: list[str] = []
        while len(self._entries) + len(self._pending) >= self.num_slots:
            victim = next((h for h in self._entries if h not in self._pins), None)
            if victim is None:
                return None
            del self._entries[victim]
            evicted.append(self.file(victim))
            if self.events is not None:
                self.events.removed(self.TIER, victim)
        self._pending.add(block_hash)
        return evicted

    def commit(self, block_hash: int, key: BlockKey) -> None:
        self._pending.discard(block_hash)
        self._entries[block_hash] = key
        if self.events is not None:
            self.events.stored(self.TIER, block_hash)

    def abandon(self, block_hash: int) -> None:
        self._pending.discard(block_hash)

    def drop(self, block_hash: int) -> str | None:
        """Forget a block whose file failed a read: the file to delete, if it was committed."""
        if self._entries.pop(block_hash, None) is None:
            return None
        if self.events is not None:
            self.events.removed(self.TIER, block_hash)
        return self.file(block_hash)

    def pin(self, block_hash: int) -> None:
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1

    def unpin(self, block_hash: int) -> None:
        left = self._pins[block_hash] - 1
        if left:
            self._pins[block_hash] = left
        else:
            del self._pins[block_hash]

    def hashes(self) -> list[int]:
        return list(self._entries)

    def close(self) -> None:
        self._finalizer()


def remove_stale(path: str) -> None:
    """Remove the tier directories under `path` of processes on this host that are gone."""
    for name in os.listdir(path):
        parts = name.split("-")
        if len(parts) < 4 or parts[:2] != ["pdserve", "kv"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _header(layout: KVLayout, key: BlockKey, digest: int) -> bytes:
    parent, tokens = key
    text = json.dumps(
        {
            "parent": None if parent is None else f"{parent:032x}",
            "tokens": list(tokens),
            "layout": layout.to_dict(),
            "digest": digest,
        },
        separators=(",", ":"),
    ).encode()
    return MAGIC + struct.pack("<I", len(text)) + text


def write_block(path: str, layout: KVLayout, key: BlockKey, pages: torch.Tensor) -> None:
    """Write one block's pages (a CPU tensor) and its key to `path`, atomically."""
    payload = pages.contiguous().view(torch.uint8).numpy()
    header = _header(layout, key, xxhash.xxh3_64_intdigest(payload))
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        f.write(header)
        f.write(payload.data)
    os.replace(temporary, path)


def read_block(path: str, layout: KVLayout, key: BlockKey, out: torch.Tensor) -> None:
    """Read the block at `path` into `out` (a CPU tensor of one block's shape); raises
    DiskBlockError unless the file holds exactly this block, intact."""
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(data)
    except OSError as exc:
        raise DiskBlockError(f"{path}: {exc.strerror or exc}") from exc
    if data[:8] != MAGIC or len(data) < 12:
        raise DiskBlockError(f"{path}: not a pdserve KV block file")
    (length,) = struct.unpack_from("<I", data, 8)
    try:
        header = json.loads(data[12 : 12 + length])
    except ValueError as exc:
        raise DiskBlockError(f"{path}: unreadable header") from exc
    payload = memoryview(data)[12 + length :]
    parent, tokens = key
    expected_parent = None if parent is None else f"{parent:032x}"
    if header.get("parent") != expected_parent or header.get("tokens") != list(tokens):
        raise DiskBlockError(f"{path}: holds another block")
    if header.get("layout") != layout.to_dict():
        raise DiskBlockError(f"{path}: another KV layout")
    nbytes = out.numel() * out.element_size()
    if len(payload) != nbytes:
        raise DiskBlockError(f"{path}: {len(payload)} bytes of pages, expected {nbytes}")
    if xxhash.xxh3_64_intdigest(payload) != header.get("digest"):
        raise DiskBlockError(f"{path}: pages fail their digest")
    out.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(payload, dtype=torch.uint8))
