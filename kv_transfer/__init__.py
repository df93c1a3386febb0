"""KV transfer: move pages from a prefill node's pool into a decode node's pool, bit for bit.

`make_receiver` / `make_sender` build a transport by name ("tcp", "shm", "cuda_ipc", "nccl");
node code uses only the `KVReceiver` / `KVSender` interface of `pdserve.kv_transfer.base`, a
send's arguments one `KVSend`:

    receiver = make_receiver("tcp", layout, num_blocks)     # decode node; owns receiver.pool
    sender = make_sender("tcp", pool)                       # prefill node
    sender.connect("decode-0", receiver.info())             # checks the layout, returns at once
    receiver.expect("req-1", dst_blocks, timeout_s=30)      # decode: blocks allocated
    sender.send(KVSend("req-1", "decode-0", src_blocks, dst_blocks, layers=(0, 16)))
    sender.send(KVSend("req-1", "decode-0", src_blocks, dst_blocks, layers=(16, 32)))
    receiver.poll() -> [TransferResult("req-1", ok=True)]   # once every layer is in
    sender.poll()   -> one result per send(); after ok the source blocks may be freed

No call blocks on the network: connect() checks the receiver's info (transport, protocol version,
layout) and returns, the handshake runs on the sender's thread, and sends made before it ends
wait for it (failing, via poll(), if the receiver refuses or does not answer in time).

A transfer is identified by its id; expect() names its full layer range (all layers by
default), and any number of sends of disjoint layer ranges deliver it, so pages of early layers
can leave while later layers still compute. Pages never land in blocks no expect() named: a send
that comes first waits (its data held) until the expect() or its own timeout. Every transfer
and send has a timeout; a peer that dies fails what it took part in on the other side at once
(dropped connection or unroutable peer), and its buffers are released. Ids of finished
transfers are remembered for a while, so late pages of a failed transfer are refused rather
than written into blocks that may have been reused. An endpoint whose thread fails says why in
`failed`: what was pending on it fails (still reported by poll()), and later calls raise
TransportFailed. Malformed messages are dropped and logged once per peer.
"""

from __future__ import annotations

import importlib

import torch

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer.base import KVReceiver, KVSend, KVSender, TransferResult, TransportFailed

# name -> (module, receiver class, sender class); modules load on first use (cupy stays optional)
TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "tcp": ("pdserve.kv_transfer.tcp", "TcpReceiver", "TcpSender"),
    "shm": ("pdserve.kv_transfer.shm", "ShmReceiver", "ShmSender"),
    "cuda_ipc": ("pdserve.kv_transfer.cuda_ipc", "CudaIpcReceiver", "CudaIpcSender"),
    "nccl": ("pdserve.kv_transfer.nccl", "NcclReceiver", "NcclSender"),
}


def _classes(name: str) -> tuple[type, type]:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {sorted(TRANSPORTS)}")
    module, receiver, sender = TRANSPORTS[name]
    mod = importlib.import_module(module)
    return getattr(mod, receiver), getattr(mod, sender)


def make_receiver(
    name: str,
    layout: KVLayout,
    num_blocks: int,
    device: str | torch.device = "cpu",
    **options,
) -> KVReceiver:
    """A receiver with a pool of its own (in shared memory for shm, one cudaMalloc for cuda_ipc).

    Options: address ("tcp://127.0.0.1:0" = a free port), advertise_host, probe_interval_s,
    max_held_bytes; tcp: max_frame_bytes (the largest chunk a sender may push).
    """
    receiver_cls, _ = _classes(name)
    return receiver_cls.create(layout, num_blocks, device, **options)


def make_sender(name: str, pool: KVPool, **options) -> KVSender:
    """A sender of `pool`'s pages. Options: connect_timeout_s, chunk_bytes, max_inflight_chunks."""
    _, sender_cls = _classes(name)
    return sender_cls(pool, **options)


__all__ = [
    "TRANSPORTS",
    "KVReceiver",
    "KVSend",
    "KVSender",
    "TransferResult",
    "TransportFailed",
    "make_receiver",
    "make_sender",
]
