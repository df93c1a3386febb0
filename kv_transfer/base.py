"""The transport interface: a KVReceiver in the decode node, a KVSender in the prefill node.

Node code is written against these two classes and `make_receiver` / `make_sender`; a transport
is added by writing one receiver and one sender class (see `kv_transfer/__init__.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.kv_cache import KVPool


class TransportFailed(RuntimeError):
    """The endpoint's thread died: every pending and later transfer on it fails with this."""


@dataclass(slots=True)
class TransferResult:
    """A transfer (receiver side) or one send() of it (sender side) that finished.

    `layers` is the layer range a sender-side result covers (None on the receiver side, where a
    result always covers the whole expected range).
    """

    transfer_id: str
    ok: bool
    error: str | None = None
    layers: tuple[int, int] | None = None


class KVReceiver(ABC):
    """Owns the decode node's pool and lands pages from senders into announced blocks."""

    name: str
    pool: KVPool

    @property
    def failed(self) -> str | None:
        """Why this endpoint stopped working (its thread died), or None. Once set, every
        pending transfer has failed and every later `expect` raises TransportFailed."""
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
        """

    @abstractmethod
    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Forget an expected transfer (its blocks are about to be reused); senders are told."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Non-blocking: transfers completed or failed (timeout, peer died) since the last poll."""

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
        """Why this endpoint stopped working (its thread died), or None. Once set, every
        pending transfer has failed and every later `send` raises TransportFailed."""
        return None

    @abstractmethod
    def connect(self, peer_id: str, receiver_info: dict) -> None:
        """Handshake with a receiver; a mismatched layout raises ValueError naming the field."""

    @abstractmethod
    def send(
        self,
        transfer_id: str,
        peer_id: str,
        src_blocks: list[int],
        dst_blocks: list[int],
        layers: tuple[int, int] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Start moving src_blocks (layers in range) into the peer's dst_blocks; returns at once.

        The source blocks must stay untouched until poll() reports this send.
        """

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Sends acknowledged by the receiver (ok: source blocks may be freed) or failed."""

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
