"""The transport interface: a KVReceiver in the decode node, a KVSender in the prefill node.

Node code is written against these two classes and `make_receiver` / `make_sender`; a transport
is added by writing one receiver and one sender class (see `kv_transfer/__init__.py`). No method
waits on a peer: what happens on the network is reported by `poll()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdserve.engine.kv.cache import KVPool


class TransportFailed(RuntimeError):
    """Raised by every call on an endpoint whose thread died (the message is its `failed`)."""


@dataclass(slots=True)
class TransferResult:
    """A transfer (receiver side) or one send() of it (sender side) that finished.

    `layers` is the layer range a sender-side result covers (None on the receiver side, where a
    result always covers the whole expected range). `integrity` (receiver side) is what the
    pages' digest check found: "ok" (every page checked and matched), "failed" (a page did not
    match, or came without its digest: the transfer failed), "off" (its sender sent no digests);
    "" where nothing was checked (a transfer that failed otherwise, or a sender-side result).
    """

    transfer_id: str
    ok: bool
    error: str | None = None
    layers: tuple[int, int] | None = None
    integrity: str = ""


@dataclass(frozen=True, slots=True)
class KVSend:
    """One `KVSender.send`: move the pages of src_blocks (layers in range, all by default) into
    the peer's dst_blocks, as part of transfer `transfer_id`, within timeout_s.

    heads / dst_heads: the KV heads [h0, h1) of each page taken from this pool and filled in the
    peer's (None: all of that pool's; as many on both sides), for tensor-parallel ranks whose
    pools hold different heads.
    """

    transfer_id: str
    peer_id: str
    src_blocks: list[int]
    dst_blocks: list[int]
    layers: tuple[int, int] | None = None
    timeout_s: float = 30.0
    heads: tuple[int, int] | None = None
    dst_heads: tuple[int, int] | None = None


class KVReceiver(ABC):
    """Owns the decode node's pool and lands pages from senders into announced blocks."""

    name: str
    pool: KVPool

    @property
    def failed(self) -> str | None:
        """Why this endpoint stopped working (its thread died), or None. Once set, every
        transfer pending then has failed with it (poll() hands those results out) and every
        later `expect` or `cancel` raises TransportFailed."""
        return None

    @abstractmethod
    def info(self) -> dict:
        """Msgpack-able handshake data a sender needs to connect (transport, layout, address...)."""

    @abstractmethod
    def expect(
        self,
        transfer_id: str,
        dst_blocks: list[int],
        layers: tuple[int, int] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Announce a transfer into dst_blocks; it completes once every layer in range arrived.

        Pages are never written into blocks no expect() has named: data that comes first waits.
        Returns at once; ValueError for bad blocks or layers, TransportFailed once failed.
        """

    @abstractmethod
    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Forget an expected transfer (its blocks are about to be reused); senders are told.
        No result is reported for it. TransportFailed once failed."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Non-blocking: transfers completed or failed (timeout, peer died, endpoint failed)
        since the last poll; one result per expect(). Works after the endpoint failed."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counts of what the receiver holds now (expected transfers, held units and bytes)."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, shared memory and buffers; pending transfers are dropped."""

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVSender(ABC):
    """Moves pages of the prefill node's pool into receivers' pools."""

    name: str
    pool: KVPool

    @property
    def failed(self) -> str | None:
        """Why this endpoint stopped working (its thread died), or None. Once set, every send
        pending then has failed with it (poll() hands those results out) and every later
        `connect` or `send` raises TransportFailed."""
        return None

    @abstractmethod
    def connect(self, peer_id: str, receiver_info: dict) -> None:
        """Start the handshake with a receiver and return at once.

        Checked here: transport, protocol version and layout (ValueError naming the field),
        and what the transport needs (e.g. the same host for shm). The receiver checks the
        layout again; sends made before its Welcome wait for it and fail (reported by poll())
        if it refuses or does not answer within connect_timeout_s. Connecting again with the
        same info is a no-op; with other info (the receiver moved) the sender reconnects.
        """

    @abstractmethod
    def send(self, send: KVSend) -> None:
        """Start moving a send's pages into the peer's blocks; returns at once.

        The source blocks must stay untouched until poll() reports this send. ValueError for bad
        arguments or a peer never connected; TransportFailed once failed; every other failure
        (refused, timed out, peer gone, handshake failed) is a result of poll().
        """

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Sends acknowledged by the receiver (ok: source blocks may be freed) or failed; one
        result per send(). Works after the endpoint failed."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counts of what the sender holds now (outstanding sends, connected peers)."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets and buffers; outstanding sends are dropped."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
