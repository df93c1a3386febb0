"""One KV transport measured on this machine: a receiver in a child process, the sender here, and
the time of each transfer from send() to the sender seeing the receiver's ack (all pages landed).
What `pdserve tune profile` fits its transfer model to, and what the transfer benchmark times."""

from __future__ import annotations

import time

import torch

from pdserve.cluster.keys import ClusterKeys
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer import make_sender
from pdserve.kv_transfer.base import KVSend
from pdserve.tune.remote_endpoint import RemoteEndpoint, wait_for

# How the receiver admits senders -> (keyed, pages encrypted)
SECURITY = {"none": (False, False), "curve": (True, True), "auth-only": (True, False)}


class TransferProbe:
    """One transport: a receiver in a child process, the sender here; keyed as `security` says."""

    def __init__(
        self,
        transport: str,
        layout: KVLayout,
        max_blocks: int,
        device: str,
        chunk_bytes: int,
        security: str = "none",
        integrity: bool = True,
    ) -> None:
        """integrity: the sender digests its pages and the receiver checks them (the default
        of every node)."""
        rx_device = "cuda:1" if transport == "nccl" else device
        keyed, encrypt = SECURITY[security]
        keys = ClusterKeys.generate() if keyed else None
        self.remote = RemoteEndpoint(
            "receiver", transport, layout, max_blocks, device=rx_device, keys=keys, encrypt=encrypt
        )
        self.pool = KVPool(layout, max_blocks, device)
        self.pool.kv.view(torch.int16).random_()  # touch every page, arbitrary bits
        self.sender = make_sender(
            transport, self.pool, chunk_bytes=chunk_bytes, keys=keys, integrity=integrity
        )
        self.sender.connect("decode", self.remote.info)
        self.count = 0

    def run(self, src: list[int], dst: list[int]) -> float:
        """One transfer; returns the seconds from send() to the sender seeing the ack."""
        self.count += 1
        tid = f"probe-{self.count}"
        self.remote.expect(tid, dst, timeout_s=120.0)  # (a pipe round trip, not timed)
        t0 = time.perf_counter()
        self.sender.send(KVSend(tid, "decode", src, dst, timeout_s=120.0))
        result = wait_for(self.sender, {}, tid, 120.0)
        elapsed = time.perf_counter() - t0
        assert result is not None and result.ok, result
        assert self.remote.wait(tid, 60.0).ok
        return elapsed

    def close(self) -> None:
        self.sender.close()
        self.remote.close()
