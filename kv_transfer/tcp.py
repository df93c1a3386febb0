"""The tcp transport: pages travel as ZeroMQ frames, between any two hosts, for CPU or GPU pools.

Each send is cut into chunks of about `chunk_bytes` (whole layers, or part of the blocks of one
layer); a chunk is a two-frame message [Pages header, pages] sent zero-copy from a staging
buffer the sender gathered into, and scattered by the receiver as it lands, so gather, wire and
scatter overlap. GPU pools are staged through pinned host buffers on both sides. The receiver's
socket takes frames up to `max_frame_bytes` (its info says so; a sender checks its chunks fit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import zmq

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer import pages
from pdserve.kv_transfer.integrity import XXH3, digest_frames, gather_and_digest
from pdserve.kv_transfer.landing import Payload
from pdserve.kv_transfer.outgoing import Outgoing, SendFailed
from pdserve.kv_transfer.pages import Chunk
from pdserve.kv_transfer.protocol import MAX_CONTROL_BYTES, Pages, ProtocolError, control
from pdserve.kv_transfer.receiver import ZmqReceiver
from pdserve.kv_transfer.sender import ZmqSender
from pdserve.kv_transfer.sender_peers import Peer


class StagingRing:
    """A few reusable host buffers lent to ZeroMQ for zero-copy sends: a buffer is reused only
    once libzmq is done with its last message (bounded memory, no page faults per chunk)."""

    def __init__(self, slots: int, capacity: int, pinned: bool) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._trackers: list[zmq.MessageTracker | None] = [None] * slots
        self._capacity = capacity
        self._pinned = pinned
        self._next = 0

    def acquire(self, nbytes: int, check: Callable[[], None]) -> tuple[int, torch.Tensor]:
        """The next free buffer (as nbytes of uint8), waiting for ZeroMQ; `check` raises to abort."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        tracker = self._trackers[i]
        while tracker is not None and not tracker.done:
            try:
                tracker.wait(0.05)
            except zmq.NotDone:
                check()
        self._trackers[i] = None
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, self._capacity)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
            self._buffers[i] = buf
        return i, buf[:nbytes]

    def lend(self, slot: int, tracker: zmq.MessageTracker) -> None:
        self._trackers[slot] = tracker

    def idle(self) -> bool:
        return all(t is None or t.done for t in self._trackers)


class TcpReceiver(ZmqReceiver):
    name = "tcp"

    @classmethod
    def create(
        cls, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", **options
    ) -> TcpReceiver:
        return cls(KVPool(layout, num_blocks, device), **options)

    def __init__(self, pool: KVPool, max_frame_bytes: int = 256 << 20, **options) -> None:
        """max_frame_bytes bounds what one peer can make the socket take in at once; senders'
        chunk_bytes must fit in it."""
        self.max_frame_bytes = max(max_frame_bytes, MAX_CONTROL_BYTES)
        self._pinned: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._pinned_next = 0
        super().__init__(pool, **options)

    def _max_frame_bytes(self) -> int:
        return self.max_frame_bytes

    def _receive(self, peer: bytes, msg: Pages, frames: list[zmq.Frame]) -> Payload:
        if msg.runs is None:
            sizes = [msg.nbytes]
        else:
            layout = pages.sliced(self.layout, msg.heads)
            plane_bytes = pages.plane_bytes(layout)
            sizes = [
                n * plane_bytes
                for _ in range(*msg.layers)
                for _ in range(layout.planes)
                for n in msg.runs
            ]
        got = [len(f) for f in frames]
        if got != sizes:
            raise ProtocolError(f"pages chunk of frames {sizes[:8]} came as {got[:8]}")
        return Payload([torch.frombuffer(f.buffer, dtype=torch.uint8) for f in frames])

    def _to_device(self, data: torch.Tensor) -> torch.Tensor:
        if data.device == self.pool.kv.device:
            return data
        # Two pinned buffers in turn: copy the frame in, then upload it asynchronously.
        nbytes = data.numel() * data.element_size()
        if len(self._pinned) < 2:
            self._pinned.append((torch.empty(0, dtype=torch.uint8), torch.cuda.Event()))
        i = self._pinned_next
        self._pinned_next = (i + 1) % 2
        buf, used = self._pinned[i]
        used.synchronize()
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = buf[:nbytes].view(data.dtype).view(data.shape)
        staged.copy_(data)
        on_device = staged.to(self.pool.kv.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        self._pinned[i] = (buf, done)
        return on_device


class TcpSender(ZmqSender):
    name = "tcp"

    def __init__(
        self, pool: KVPool, max_pool_runs: int = 4, min_pool_frame: int = 256 << 10, **options
    ) -> None:
        """Chunks whose source blocks form at most max_pool_runs runs, each frame at least
        min_pool_frame bytes, are sent from the pool itself; more, smaller pieces cost more per
        frame than one gather."""
        super().__init__(pool, **options)
        self.max_pool_runs = max_pool_runs
        self.min_pool_frame = min_pool_frame
        self._ring = StagingRing(self.max_inflight_chunks, self.chunk_bytes, pool.kv.is_cuda)

    def _check_receiver(self, info: dict) -> None:
        # A chunk is at most chunk_bytes, or one page of one layer where that is more.
        largest = max(self.chunk_bytes, pages.page_bytes(self.layout))
        limit = info.get("max_frame_bytes")
        if limit is not None and largest > limit:
            raise ValueError(
                f"chunks of up to {largest} bytes (chunk_bytes {self.chunk_bytes}) exceed the "
                f"receiver's max_frame_bytes {limit}"
            )

    def _emit(
        self, peer: Peer, out: Outgoing, header: Pages, chunk: Chunk, src: torch.Tensor
    ) -> None:
        if out.heads is None and self._send_from_pool(peer, header, chunk, src):
            return
        slot, buf = self._ring.acquire(header.nbytes, lambda: self._check_peer(peer, out))
        if self.pool.kv.is_cuda:
            data = self._gather(chunk, src, heads=out.heads)
            header.digest = self._digest(data)
            with torch.cuda.stream(self._stream):
                buf.copy_(data.reshape(-1).view(torch.uint8), non_blocking=True)
            self._stream.synchronize()
        else:  # gather straight into the buffer ZeroMQ sends from
            shape = chunk.shape(pages.sliced(self.layout, out.heads))
            view = buf.view(self.layout.torch_dtype).view(shape)
            fused = None
            if self.integrity == XXH3 and out.heads is None:
                fused = gather_and_digest(self.pool.kv, src.tolist(), chunk.layers, view)
            if fused is None:
                self._gather(chunk, src, out=view, heads=out.heads)
                fused = self._digest(view)
            header.digest = fused
        try:
            peer.sock.send(control.encode(header), zmq.SNDMORE | zmq.NOBLOCK)
            tracker = peer.sock.send(buf.numpy(), zmq.NOBLOCK, copy=False, track=True)
        except zmq.Again as e:
            raise SendFailed(f"receiver {peer.peer_id!r} is not reachable") from e
        self._ring.lend(slot, tracker)

    def _send_from_pool(self, peer: Peer, header: Pages, chunk: Chunk, src: torch.Tensor) -> bool:
        """Source blocks in a few long runs go out as frames of the pool itself: no gather.
        (They stay untouched until the ack, which comes after ZeroMQ is done with them.)"""
        if self.pool.kv.is_cuda:
            return False
        runs = pages.source_runs(src.tolist())
        plane_bytes = pages.plane_bytes(self.layout)
        if (
            len(runs) > self.max_pool_runs
            or min(n for _, n in runs) * plane_bytes < self.min_pool_frame
        ):
            return False
        kv = self.pool.kv
        frames = [
            kv[layer, plane, start : start + n].view(torch.uint8).numpy()
            for layer in range(*chunk.layers)
            for plane in range(self.layout.planes)
            for start, n in runs
        ]
        header.runs = [n for _, n in runs]
        if self.integrity is not None:
            header.digest = digest_frames(frames, self.integrity)
        try:
            peer.sock.send(control.encode(header), zmq.SNDMORE | zmq.NOBLOCK)
            peer.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again as e:
            raise SendFailed(f"receiver {peer.peer_id!r} is not reachable") from e
        return True
