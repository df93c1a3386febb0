"""The shm transport: two processes on one host; the receiver's pool lives in shared memory.

The sender maps the receiver's pool and copies its pages straight into the destination blocks
(after the receiver's Go); only the Begin / Go / Done / Ack control messages cross a socket.
The segment is a file in /dev/shm (Linux) unlinked by its owner on close or at exit, and, if the
owner is killed, by a tiny watchdog process that waits for the owner's end of a pipe to close.
"""

from __future__ import annotations

import atexit
import os
import socket as pysocket
import subprocess
import sys
import uuid

import torch

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer import pages
from pdserve.kv_transfer.integrity import XXH3, copy_and_digest
from pdserve.kv_transfer.outgoing import Outgoing, SendFailed
from pdserve.kv_transfer.protocol import Written
from pdserve.kv_transfer.receiver import ZmqReceiver
from pdserve.kv_transfer.sender import ZmqSender
from pdserve.kv_transfer.sender_peers import Peer

SHM_DIR = "/dev/shm"
# Runs with no site packages: blocks until its stdin (the owner's pipe) closes, then unlinks.
_WATCHDOG = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "sys.stdin.buffer.read()\n"
    "try:\n"
    "    os.unlink(sys.argv[1])\n"
    "except FileNotFoundError:\n"
    "    pass\n"
)


def map_pool(path: str, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Map a pool file shared: the mapping lives as long as the tensor (and its views)."""
    shape = pages.pool_shape(layout, num_blocks)
    numel = 1
    for d in shape:
        numel *= d
    return torch.from_file(path, shared=True, size=numel, dtype=layout.torch_dtype).view(shape)


class SharedSegment:
    """A named shared-memory file that never outlives its owner process."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._watchdog = subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHDOG, self.path],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a ^C to the owner's group must not kill it first
        )
        atexit.register(self.unlink)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._watchdog.poll() is None:
            self._watchdog.stdin.close()
            self._watchdog.wait(timeout=10.0)
        atexit.unregister(self.unlink)

    @property
    def exists(self) -> bool:
        return os.path.exists(self.path)


class ShmReceiver(ZmqReceiver):
    name = "shm"

    @classmethod
    def create(
        cls, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", **options
    ) -> ShmReceiver:
        if torch.device(device).type != "cpu":
            raise ValueError("the shm transport shares CPU pools only")
        segment = SharedSegment(layout.bytes_per_block * num_blocks)
        try:
            kv = map_pool(segment.path, layout, num_blocks)
            return cls(KVPool(layout, num_blocks, "cpu", kv=kv), segment, **options)
        except BaseException:
            segment.unlink()
            raise

    def __init__(self, pool: KVPool, segment: SharedSegment, **options) -> None:
        self.segment = segment
        super().__init__(pool, **options)

    def _info_extra(self) -> dict:
        return {"shm_path": self.segment.path, "host": pysocket.gethostname()}

    def _release(self) -> None:
        # Mappings (ours, the senders') stay valid until unmapped; the name goes now.
        self.segment.unlink()


class ShmSender(ZmqSender):
    name = "shm"
    direct = True

    def __init__(self, pool: KVPool, **options) -> None:
        if pool.kv.device.type != "cpu":
            raise ValueError("the shm transport shares CPU pools only")
        super().__init__(pool, **options)

    def _check_receiver(self, info: dict) -> None:
        if info.get("host") != pysocket.gethostname():
            raise ValueError(f"shm receiver is on host {info.get('host')!r}, not this one")

    def _prepare_peer(self, peer: Peer) -> None:
        info = peer.info
        layout = KVLayout.from_dict(info["layout"])  # its head count may differ from ours
        peer.extra["kv"] = map_pool(info["shm_path"], layout, info["num_blocks"])

    def _write(self, peer: Peer, out: Outgoing) -> int | None:
        if self.integrity == XXH3 and out.heads is None and out.dst_heads is None:
            if self._write_in_chunks(peer, out):
                return None
        pages.copy(
            self.pool.kv,
            out.src_blocks,
            peer.extra["kv"],
            out.dst_blocks,
            out.layers,
            out.heads,
            out.dst_heads,
        )
        return self._digest_pages(out)

    def _write_in_chunks(self, peer: Peer, out: Outgoing) -> bool:
        """Copy a send chunk by chunk, hashing each piece of the source as it goes, and say
        each chunk `Written` with its digest: the receiver checks one while the next is
        copied. False (nothing copied) where the blocks lie in too many runs."""
        dst_kv = peer.extra["kv"]
        chunks = list(
            pages.plan_chunks(self.layout, len(out.src_blocks), out.layers, self.chunk_bytes)
        )
        for chunk in chunks:
            src, dst = out.src_blocks[chunk.lo : chunk.hi], out.dst_blocks[chunk.lo : chunk.hi]
            digest = copy_and_digest(self.pool.kv, src, dst_kv, dst, chunk.layers)
            if digest is None:
                if chunk is chunks[0]:
                    return False
                raise SendFailed("a chunk of a send could not be copied")  # (never: same runs)
            self._send_to(
                peer,
                Written(out.transfer_id, out.send_id, chunk.layers, chunk.lo, chunk.hi, digest),
            )
        return True

    def _release_peer(self, peer: Peer) -> None:
        peer.extra.clear()  # drops the mapping
