"""The ZeroMQ control channel every transport shares: a ROUTER in the receiver, a DEALER per
receiver in the sender, with heartbeats so a silent peer is dropped, the cluster keys that let a
sender in, a thread waker, and the command thread both endpoints run.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket as pysocket
import threading
from collections import deque
from typing import Any

import zmq

from pdserve.cluster.keys import (
    ClusterKeys,
    close_server,
    curve_client,
    curve_server,
    plain_client,
    plain_server,
)
from pdserve.kv_transfer.base import TransferResult, TransportFailed

log = logging.getLogger(__name__)

# ZMTP heartbeats: a peer that stops answering for this long is disconnected, which the sender
# sees on its monitor socket and the receiver sees as an unroutable peer.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


def configure(sock: zmq.Socket, max_frame_bytes: int) -> None:
    """Options every control socket gets; a peer that sends a frame over max_frame_bytes is
    disconnected by ZeroMQ before the frame is read into memory."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    # Queues are bounded by the senders' own in-flight limits, never by dropping messages.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)


class Security:
    """How a receiver admits senders, as its info tells them: `none` (anyone, in clear: a cluster
    run insecure), `curve` (holders of the cluster keys, encrypted) or `plain` (a password of this
    receiver's, which only reaches senders through the keyed coordinator; pages in clear)."""

    def __init__(self, keys: ClusterKeys | None, encrypt: bool = True) -> None:
        self.keys = keys
        self.mode = "none" if keys is None else "curve" if encrypt else "plain"
        self.password = secrets.token_urlsafe(24) if self.mode == "plain" else None

    def serve(self, sock: zmq.Socket, label: str) -> None:
        if self.mode == "curve":
            curve_server(sock, self.keys, label)
        elif self.mode == "plain":
            plain_server(sock, self.password.encode(), label)

    def info(self) -> dict:
        return {"security": self.mode, **({"password": self.password} if self.password else {})}


def check_security(keys: ClusterKeys | None, info: dict) -> None:
    """A sender's keys fit the receiver's security (ValueError if not): a keyed sender never
    falls back to a receiver that admits anyone, nor an unkeyed one to a keyed receiver."""
    mode = info.get("security", "none")
    if mode not in ("none", "curve", "plain") or (mode == "plain" and not info.get("password")):
        raise ValueError(f"receiver security {mode!r} is not known")
    if keys is None and mode != "none":
        raise ValueError("the receiver admits only holders of the cluster keys; this node has none")
    if keys is not None and mode == "none":
        raise ValueError(
            "the receiver runs insecure and this node holds cluster keys: start every process "
            "of a cluster with the same keys (or all with --insecure)"
        )


def secure_dealer(sock: zmq.Socket, keys: ClusterKeys | None, info: dict) -> None:
    """Key a sender's socket (before it connects) as the receiver's info asks."""
    mode = info.get("security", "none")
    if mode == "curve":
        curve_client(sock, keys)
    elif mode == "plain":
        plain_client(sock, info["password"].encode())


def bind_router(
    ctx: zmq.Context,
    address: str,
    max_frame_bytes: int,
    advertise_host: str | None = None,
    security: Security | None = None,
) -> tuple[zmq.Socket, str]:
    """Bind a ROUTER at `address` (port 0 = any free port); return it and the address to dial."""
    sock = ctx.socket(zmq.ROUTER)
    configure(sock, max_frame_bytes)
    if security is not None:
        security.serve(sock, "KV receiver")
    # Sending to a peer that is gone raises EHOSTUNREACH instead of dropping silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if address.startswith("tcp://") and address.rsplit(":", 1)[1] == "0":
        address = address.rsplit(":", 1)[0] + ":*"
    try:
        sock.bind(address)
    except zmq.ZMQError:
        close_server(sock)  # (and its context's ZAP handler, if it was keyed)
        raise
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if endpoint.startswith("tcp://"):
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        if host in ("0.0.0.0", "[::]", "*"):
            host = advertise_host or pysocket.gethostname()
        elif advertise_host:
            host = advertise_host
        endpoint = f"tcp://{host}:{port}"
    return sock, endpoint


class Waker:
    """Wakes a thread blocked in zmq.Poller from any other thread (a pipe: no socket sharing)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self._r, zmq.POLLIN)

    @property
    def fd(self) -> int:
        return self._r

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):
            pass  # already pending, or closed during shutdown

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class CommandThread:
    """What a sender and a receiver share: a background thread fed by a command queue (woken
    through a Waker), results handed to the step loop by poll(), stats read under a lock.

    A thread that raises marks its endpoint failed: every transfer pending on it, and every
    command it will never apply, fails with the reason (still handed out by poll()), and every
    later call raises TransportFailed."""

    name: str
    _role = "thread"

    def _start_thread(self, stats: dict[str, int]) -> None:
        self._commands: deque[tuple] = deque()
        # Taken to queue a command and to fail for good, so no command slips in after the
        # thread has given up on the queue (it would never get a result).
        self._command_lock = threading.Lock()
        self._results: deque[TransferResult] = deque()  # what poll() hands out
        self._finished: list[TransferResult] = []  # made this round; out after the stats
        self._stats = stats
        self._stats_lock = threading.Lock()
        self._waker = Waker()
        self._closed = False
        self._failure: str | None = None  # why the thread died, once it has
        self._thread = threading.Thread(
            target=self._run, name=f"kv-{self.name}-{self._role}", daemon=True
        )
        self._thread.start()

    # -- subclass hooks ----------------------------------------------------------------------
    def _run(self) -> None:
        raise NotImplementedError

    def _fail_pending(self, why: str) -> None:
        """Fail every transfer the thread holds (results into _finished, peers told if they can
        be); called on the thread as it dies."""
        raise NotImplementedError

    def _never_applied(self, cmd: tuple, why: str) -> TransferResult | None:
        """The result owed for a queued command the dead thread will never apply."""
        return None

    def _publish_stats(self) -> None:
        self._hand_out()

    # -- callers' side -----------------------------------------------------------------------
    def _command(self, *cmd: Any) -> None:
        with self._command_lock:
            self._check_open()
            self._commands.append(cmd)
        self._waker.wake()

    @property
    def failed(self) -> str | None:
        """Why this endpoint's thread died (None while it runs): the endpoint is unusable."""
        return self._failure

    def _check_open(self) -> None:
        if self._failure is not None:
            raise TransportFailed(self._failure)
        if self._closed:
            raise RuntimeError(f"{self.name} {self._role} is closed")

    def poll(self) -> list[TransferResult]:
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    def _stop_thread(self) -> bool:
        """Stop the thread; False if it is stuck (its context must then be left, not termed)."""
        self._closed = True
        self._commands.append(("stop",))
        self._waker.wake()
        self._thread.join(timeout=10.0)
        self._waker.close()
        if self._thread.is_alive():  # stuck in a copy: leave the context rather than hang
            log.error("%s %s thread did not stop", self.name, self._role)
            return False
        return True

    # -- thread's side -----------------------------------------------------------------------
    def _hand_out(self) -> None:
        self._results.extend(self._finished)
        self._finished.clear()

    def _die(self, error: Exception) -> None:
        """The thread raised: refuse every later call, fail what is pending and what is queued,
        and hand the results out (poll() works on without the thread)."""
        log.error("%s %s thread failed", self.name, self._role, exc_info=error)
        why = f"{self.name} {self._role} thread failed: {error!r}"
        with self._command_lock:
            self._failure = why
            queued = list(self._commands)
            self._commands.clear()
        try:
            self._fail_pending(why)
        except Exception:  # what could be failed is in _finished; the rest is lost with it
            log.exception("%s %s: failing pending transfers", self.name, self._role)
        self._finished += [r for cmd in queued if (r := self._never_applied(cmd, why)) is not None]
        try:
            self._publish_stats()
        except Exception:  # the results go out regardless
            log.exception("%s %s: publishing stats", self.name, self._role)
        self._hand_out()
