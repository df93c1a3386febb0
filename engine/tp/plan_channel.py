"""How rank 0 hands each step's plan to the other tensor-parallel ranks of its node: the pickled
plan in one shared-memory buffer, and one pipe per rank carrying a byte per plan put there (its
end of file says rank 0 is gone).

Chosen over torch.distributed's broadcast_object_list by measurement (bench/tp_overhead.py,
docs/benchmarks.md): the broadcast pickles the same bytes, then moves their size and the bytes
in two collectives; here they are one copy and one wake-up. A rank reads a plan before the
step's first all-reduce, and rank 0 writes the next only after that all-reduce, so one buffer
suffices.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("<Q")  # the pickle's length


class PlanTooLarge(ValueError):
    """A plan that does not fit the channel's buffer (sized for the engine's limits)."""


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PublisherGone(EOFError):
    """Rank 0's end of the channel closed: its process is gone."""


@dataclass
class PlanInbox:
    """One receiving rank's end: picklable, handed to its process with the pipe's descriptor."""

    path: str
    capacity: int
    fd: int  # the read end of the rank's pipe, inherited by its process

    def open(self) -> PlanReader:
        return PlanReader(self)


class PlanReader:
    def __init__(self, inbox: PlanInbox) -> None:
        with open(inbox.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), HEADER.size + inbox.capacity, access=mmap.ACCESS_READ)
        self._fd = inbox.fd

    def receive(self) -> Any:
        """The next object rank 0 published; waits for it. PublisherGone once rank 0 is gone."""
        if not os.read(self._fd, 1):
            raise PublisherGone("rank 0 closed the plan channel")
        (length,) = HEADER.unpack_from(self._buf, 0)
        return pickle.loads(self._buf[HEADER.size : HEADER.size + length])

    def close(self) -> None:
        self._buf.close()


class PlanChannel:
    """Rank 0's end: publish to every other rank. Its file is unlinked once every rank mapped
    it (`unlink`, after the group formed), so nothing is left behind however processes end."""

    def __init__(self, num_receivers: int, capacity: int) -> None:
        self.capacity = capacity
        self.path = os.path.join(_shm_dir(), f"pdserve-plans-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, HEADER.size + capacity)  # sparse: pages appear as plans use them
            self._buf = mmap.mmap(fd, HEADER.size + capacity)
        finally:
            os.close(fd)
        self._pipes = [os.pipe() for _ in range(num_receivers)]

    def inbox(self, index: int) -> PlanInbox:
        return PlanInbox(self.path, self.capacity, self._pipes[index][0])

    def handed_over(self, index: int) -> None:
        """Receiver `index`'s process holds its end now: close ours (its end of file then
        follows this process's)."""
        read, write = self._pipes[index]
        if read >= 0:
            os.close(read)
            self._pipes[index] = (-1, write)

    def publish(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.capacity:
            raise PlanTooLarge(f"a plan of {len(data)} bytes exceeds the channel's {self.capacity}")
        HEADER.pack_into(self._buf, 0, len(data))
        self._buf[HEADER.size : HEADER.size + len(data)] = data
        for _, write in self._pipes:
            os.write(write, b"\x01")

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        for index, (_, write) in enumerate(self._pipes):
            self.handed_over(index)
            os.close(write)
        self._pipes = []
        self._buf.close()


def plan_capacity(max_num_batched_tokens: int, max_blocks_per_seq: int) -> int:
    """Bytes of the largest plan the engine's limits allow, with room for pickle's framing: 3
    int64 per token; per sequence (at most one per token) 2 int64, its block table row and its
    sampled row."""
    tokens = max_num_batched_tokens
    return 64 * 1024 + tokens * (3 * 8) + tokens * (2 * 8 + 4 * max_blocks_per_seq + 10)
