"""A KV receiver or sender running in a child process, driven over a pipe: what the transfer probe
(`pdserve tune profile`, the transfer benchmark) and the two-process tests use to put each side of
a transport in its own process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import torch

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer.base import TransferResult


def pool_bytes(kv: torch.Tensor, blocks: list[int] | None = None) -> bytes:
    """The raw bits of a pool (or of some of its blocks, all layers), for comparing exactly."""
    if blocks is not None:
        kv = kv[:, :, blocks]
    return kv.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def wait_for(endpoint, done: dict, transfer_id: str, timeout_s: float) -> TransferResult | None:
    """Poll until a result for transfer_id comes (others seen meanwhile are kept in `done`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for r in endpoint.poll():
            done[r.transfer_id] = r
        if transfer_id in done:
            return done.pop(transfer_id)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.0002)


def _serve(conn, role: str, name: str, layout: dict, num_blocks: int, device: str, options: dict):
    from pdserve.kv_transfer import make_receiver, make_sender

    lay = KVLayout.from_dict(layout)
    if role == "receiver":
        endpoint = make_receiver(name, lay, num_blocks, device=device, **options)
    else:
        endpoint = make_sender(name, KVPool(lay, num_blocks, device), **options)
    done: dict[str, TransferResult] = {}
    conn.send(("ok", endpoint.info() if role == "receiver" else None))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            break
        try:
            if method == "wait":
                value = wait_for(endpoint, done, *args, **kwargs)
            elif method == "read_blocks":
                value = pool_bytes(endpoint.pool.kv, *args)
            elif method == "load_pool":
                data = torch.frombuffer(bytearray(args[0]), dtype=torch.uint8)
                endpoint.pool.kv.copy_(
                    data.view(endpoint.pool.kv.dtype).view(endpoint.pool.kv.shape)
                )
                value = None
            else:
                value = getattr(endpoint, method)(*args, **kwargs)
            conn.send(("ok", value))
        except Exception as e:  # the caller re-raises it
            conn.send(("error", e))
        if method == "close":
            break


def _process_context():
    """forkserver where there is one: torch is imported once in the server and every child
    forks from it ready (a fresh spawn spends seconds importing torch); spawn elsewhere."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["pdserve.tune.remote_endpoint", "pdserve.kv_transfer.tcp", "pdserve.kv_transfer.shm"]
        )
        return ctx
    return mp.get_context("spawn")


class RemoteEndpoint:
    """Proxy for a receiver or sender in a child process: call its methods by name."""

    def __init__(
        self,
        role: str,
        name: str,
        layout: KVLayout,
        num_blocks: int,
        device: str = "cpu",
        start_timeout_s: float = 60.0,
        **options: Any,
    ) -> None:
        ctx = _process_context()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve,
            args=(child, role, name, layout.to_dict(), num_blocks, device, options),
            daemon=True,
        )
        self.process.start()
        child.close()
        self.info = self._reply(start_timeout_s)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _reply(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError("no answer from the child process")
        status, value = self._conn.recv()
        if status == "error":
            raise value
        return value

    def call(self, method: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        self._conn.send((method, args, kwargs))
        return self._reply(timeout_s)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def kill(self) -> None:
        """SIGKILL the child: no cleanup of its own runs."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10.0)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close", timeout_s=20.0)
            except (EOFError, OSError, TimeoutError):
                pass
            self.process.join(timeout=10.0)
            if self.process.is_alive():
                self.kill()
        self._conn.close()
