"""The cuda_ipc transport: GPUs of one node; the sender writes into the receiver's GPU pool.

The receiver allocates its pool as one cudaMalloc (so a CuPy IPC memory handle covers exactly
the pool) and publishes the handle. The sender opens it, wraps it as a tensor on its own device
(peer access is enabled lazily by the driver) and copies its blocks into the destination blocks
with one Triton kernel on a side stream, then says Done. CuPy is imported only when used.
"""

from __future__ import annotations

import os
import socket as pysocket

import torch

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer import pages
from pdserve.kv_transfer.outgoing import Outgoing
from pdserve.kv_transfer.receiver import ZmqReceiver
from pdserve.kv_transfer.sender import ZmqSender
from pdserve.kv_transfer.sender_peers import Peer


def _cupy():
    import cupy

    return cupy


def wrap_device_memory(ptr: int, nbytes: int, owner: object, device: int, layout, num_blocks):
    """A torch view of raw device memory as a pool tensor (no copy, no ownership)."""
    cupy = _cupy()
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device)
    raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return (
        torch.from_dlpack(raw).view(layout.torch_dtype).view(pages.pool_shape(layout, num_blocks))
    )


class CudaIpcReceiver(ZmqReceiver):
    name = "cuda_ipc"

    @classmethod
    def create(
        cls, layout: KVLayout, num_blocks: int, device: str | torch.device = "cuda", **options
    ) -> CudaIpcReceiver:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError("the cuda_ipc transport needs a CUDA pool")
        cupy = _cupy()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        nbytes = layout.bytes_per_block * num_blocks
        with cupy.cuda.Device(index):
            mem = cupy.cuda.Memory(nbytes)  # a cudaMalloc of its own: the handle maps the pool
            kv = wrap_device_memory(mem.ptr, nbytes, mem, index, layout, num_blocks)
            kv.zero_()
            handle = cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)
        return cls(KVPool(layout, num_blocks, kv.device, kv=kv), mem, bytes(handle), **options)

    def __init__(self, pool: KVPool, memory: object, handle: bytes, **options) -> None:
        self._memory = memory  # keeps the allocation alive as long as the receiver
        self._handle = handle
        super().__init__(pool, **options)

    def _info_extra(self) -> dict:
        return {
            "ipc_handle": self._handle,
            "nbytes": self.layout.bytes_per_block * self.pool.num_blocks,
            "host": pysocket.gethostname(),
            "pid": os.getpid(),
        }

    def _release(self) -> None:
        torch.cuda.synchronize(self.pool.kv.device)
        self._memory = None  # freed once the pool tensor is gone too


class CudaIpcSender(ZmqSender):
    name = "cuda_ipc"
    direct = True

    def __init__(self, pool: KVPool, **options) -> None:
        if not pool.kv.is_cuda:
            raise ValueError("the cuda_ipc transport needs a CUDA pool")
        self._device = pool.kv.device.index if pool.kv.device.index is not None else 0
        super().__init__(pool, **options)

    def _check_receiver(self, info: dict) -> None:
        if info.get("host") != pysocket.gethostname():
            raise ValueError(f"cuda_ipc receiver is on host {info.get('host')!r}, not this one")

    def _prepare_peer(self, peer: Peer) -> None:
        cupy = _cupy()
        info = peer.info
        with cupy.cuda.Device(self._device):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(info["ipc_handle"])
        peer.extra["ptr"] = ptr
        layout = KVLayout.from_dict(info["layout"])  # its head count may differ from ours
        peer.extra["kv"] = wrap_device_memory(
            ptr, info["nbytes"], None, self._device, layout, info["num_blocks"]
        )

    def _write(self, peer: Peer, out: Outgoing) -> int | None:
        with torch.cuda.stream(self._stream):
            if out.ready is not None:
                self._stream.wait_event(out.ready)
            pages.copy(
                self.pool.kv,
                out.src_blocks,
                peer.extra["kv"],
                out.dst_blocks,
                out.layers,
                out.heads,
                out.dst_heads,
            )
            digest = self._digest_pages(out)  # on the device, on the stream that copied
        self._stream.synchronize()  # the pages are in before the receiver hears Done
        return digest

    def _release_peer(self, peer: Peer) -> None:
        ptr = peer.extra.pop("ptr", None)
        peer.extra.clear()
        if ptr is not None:
            cupy = _cupy()
            with cupy.cuda.Device(self._device):
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)
