"""The nccl transport: point-to-point NCCL send/recv between a prefill and a decode GPU, across
nodes over InfiniBand / RoCE, with CuPy's NCCL bindings.

Each sender-receiver pair is a two-rank communicator (sender rank 0, receiver rank 1) whose
unique id the receiver makes and hands over in the ZMQ Welcome. A send is cut into chunks as in
tcp; for each, the Pages header goes over ZMQ and the gathered pages over NCCL, one send per
layer fused in a group. The receiver posts the matching grouped recvs into a device buffer,
scatters it once its event completes, and acks over ZMQ. CuPy is imported only when used.
"""

from __future__ import annotations

import time

import torch
import zmq

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer.landing import Payload
from pdserve.kv_transfer.outgoing import Outgoing, SendFailed
from pdserve.kv_transfer.pages import Chunk
from pdserve.kv_transfer.protocol import Hello, Pages, ProtocolError, control
from pdserve.kv_transfer.receiver import ZmqReceiver
from pdserve.kv_transfer.sender import ZmqSender
from pdserve.kv_transfer.sender_peers import Peer

SENDER_RANK, RECEIVER_RANK = 0, 1


def _nccl():
    from cupy.cuda import nccl

    return nccl


def unique_id_to_wire(uid) -> bytes | list[int]:
    """CuPy returns the id as a tuple of 128 signed chars (older) or bytes (newer)."""
    return bytes(uid) if isinstance(uid, (bytes, bytearray)) else list(uid)


def unique_id_from_wire(wire):
    return bytes(wire) if isinstance(wire, (bytes, bytearray)) else tuple(wire)


def _layer_pieces(nbytes: int, num_layers: int) -> list[tuple[int, int]]:
    """(offset, size) of each layer's pages in a chunk buffer [layers, planes, n, ...]."""
    per = nbytes // num_layers
    return [(i * per, per) for i in range(num_layers)]


class NcclReceiver(ZmqReceiver):
    name = "nccl"

    @classmethod
    def create(
        cls, layout: KVLayout, num_blocks: int, device: str | torch.device = "cuda", **options
    ) -> NcclReceiver:
        if torch.device(device).type != "cuda":
            raise ValueError("the nccl transport needs a CUDA pool")
        return cls(KVPool(layout, num_blocks, device), **options)

    def __init__(self, pool: KVPool, **options) -> None:
        self._comms: dict[bytes, object] = {}
        super().__init__(pool, **options)

    def _welcome(self, peer: bytes, hello: Hello) -> dict:
        return {"unique_id": unique_id_to_wire(_nccl().get_unique_id())}

    def _after_welcome(self, peer: bytes, extra: dict) -> None:
        old = self._comms.pop(peer, None)
        if old is not None:
            old.abort()
        # Blocks until the sender joins with the same id (it does so on our Welcome).
        uid = unique_id_from_wire(extra["unique_id"])
        self._comms[peer] = _nccl().NcclCommunicator(2, uid, RECEIVER_RANK)

    def _receive(self, peer: bytes, msg: Pages, frames: list[zmq.Frame]) -> Payload:
        nccl = _nccl()
        comm = self._comms.get(peer)
        if comm is None:
            raise ProtocolError("pages over NCCL before the communicator was made")
        if frames:
            raise ProtocolError(
                f"pages header followed by {len(frames)} frames (NCCL carries them)"
            )
        # Receives and scatters share one stream (and the buffer is allocated for it), so the
        # buffer is not reused before the scatter that reads it has run.
        with torch.cuda.stream(self._stream):
            buf = torch.empty(msg.nbytes, dtype=torch.uint8, device=self.pool.kv.device)
        stream = self._stream.cuda_stream
        nccl.groupStart()
        for offset, size in _layer_pieces(msg.nbytes, msg.layers[1] - msg.layers[0]):
            comm.recv(buf.data_ptr() + offset, size, nccl.NCCL_UINT8, SENDER_RANK, stream)
        nccl.groupEnd()
        done = torch.cuda.Event()
        done.record(self._stream)
        return Payload([buf], done)

    def _to_device(self, data: torch.Tensor) -> torch.Tensor:
        return data  # already there

    def _peer_gone(self, peer: bytes) -> None:
        comm = self._comms.pop(peer, None)
        if comm is not None:
            comm.abort()  # recvs posted for a dead peer would never end

    def _release(self) -> None:
        for comm in self._comms.values():
            comm.abort()
        self._comms.clear()


class NcclSender(ZmqSender):
    name = "nccl"

    def __init__(self, pool: KVPool, **options) -> None:
        if not pool.kv.is_cuda:
            raise ValueError("the nccl transport needs a CUDA pool")
        self._lent: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        super().__init__(pool, **options)

    def _welcomed(self, peer: Peer, extra: dict) -> None:
        uid = unique_id_from_wire(extra["unique_id"])
        peer.extra["comm"] = _nccl().NcclCommunicator(2, uid, SENDER_RANK)

    def _emit(
        self, peer: Peer, out: Outgoing, header: Pages, chunk: Chunk, src: torch.Tensor
    ) -> None:
        nccl = _nccl()
        self._lent = [(e, t) for e, t in self._lent if not e.query()]
        while len(self._lent) >= self.max_inflight_chunks:  # bound device memory in flight
            self._check_peer(peer, out)
            time.sleep(0.0002)
            self._lent = [(e, t) for e, t in self._lent if not e.query()]
        data = self._gather(chunk, src, heads=out.heads)
        header.digest = self._digest(data)  # on the device; waits for the gather
        try:
            peer.sock.send(control.encode(header), zmq.NOBLOCK)
        except zmq.Again as e:
            raise SendFailed(f"receiver {peer.peer_id!r} is not reachable") from e
        comm, stream = peer.extra["comm"], self._stream.cuda_stream
        nccl.groupStart()
        for offset, size in _layer_pieces(header.nbytes, chunk.layers[1] - chunk.layers[0]):
            comm.send(data.data_ptr() + offset, size, nccl.NCCL_UINT8, RECEIVER_RANK, stream)
        nccl.groupEnd()
        done = torch.cuda.Event()
        done.record(self._stream)
        self._lent.append((done, data))  # the buffer lives until NCCL has read it

    def _release_peer(self, peer: Peer) -> None:
        comm = peer.extra.pop("comm", None)
        if comm is not None:
            comm.abort()
