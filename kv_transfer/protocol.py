"""Control messages between a KV sender and receiver: msgpack maps with a version and a kind.

Sender to receiver: Hello, Pages (header of a chunk of pages that follows in the same ZMQ
message or over NCCL), Begin / Done (a direct write into a mapped pool), Abort.
Receiver to sender: Welcome / Refuse (handshake), Go (write now), Ack / Nack (per send), Ping.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import msgpack

PROTOCOL_VERSION = 1


class ProtocolError(RuntimeError):
    """A message that is not ours or from another protocol version."""


@dataclass(slots=True)
class Hello:
    KIND: ClassVar[str] = "hello"
    sender: str
    transport: str
    layout: dict
    host: str
    pid: int


@dataclass(slots=True)
class Welcome:
    KIND: ClassVar[str] = "welcome"
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class Refuse:
    KIND: ClassVar[str] = "refuse"
    error: str


@dataclass(slots=True)
class Pages:
    """One chunk of a send: layers [layers) x dst[lo:hi] of that send, K and V.

    The first chunk of a send opens it (dst, send_layers, timeout_s set); the last one closes it.
    Its pages come as one gathered [layers, 2, n, ...] buffer, or, when `runs` is set (lengths of
    runs of consecutive source blocks), as one buffer per (layer, K/V, run) in that order, sent
    straight from the sender's pool.
    """

    KIND: ClassVar[str] = "pages"
    transfer_id: str
    send_id: int
    layers: list[int]
    lo: int
    hi: int
    nbytes: int
    first: bool
    last: bool
    dst: list[int] | None = None
    send_layers: list[int] | None = None
    timeout_s: float = 30.0
    runs: list[int] | None = None


@dataclass(slots=True)
class Begin:
    """Ask to write layers x dst of a transfer straight into the receiver's (mapped) pool."""

    KIND: ClassVar[str] = "begin"
    transfer_id: str
    send_id: int
    layers: list[int]
    dst: list[int]
    timeout_s: float = 30.0


@dataclass(slots=True)
class Go:
    KIND: ClassVar[str] = "go"
    send_id: int


@dataclass(slots=True)
class Done:
    KIND: ClassVar[str] = "done"
    transfer_id: str
    send_id: int


@dataclass(slots=True)
class Abort:
    KIND: ClassVar[str] = "abort"
    transfer_id: str
    send_id: int
    error: str


@dataclass(slots=True)
class Ack:
    KIND: ClassVar[str] = "ack"
    transfer_id: str
    send_id: int


@dataclass(slots=True)
class Nack:
    KIND: ClassVar[str] = "nack"
    transfer_id: str
    send_id: int
    error: str


@dataclass(slots=True)
class Ping:
    KIND: ClassVar[str] = "ping"


Message = Hello | Welcome | Refuse | Pages | Begin | Go | Done | Abort | Ack | Nack | Ping
_KINDS: dict[str, type] = {
    cls.KIND: cls
    for cls in (Hello, Welcome, Refuse, Pages, Begin, Go, Done, Abort, Ack, Nack, Ping)
}


def encode(msg: Message) -> bytes:
    body = {f.name: getattr(msg, f.name) for f in fields(msg)}
    body["v"] = PROTOCOL_VERSION
    body["kind"] = msg.KIND
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes | memoryview) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False)
        version, kind = body.pop("v"), body.pop("kind")
    except Exception as e:  # any garbage is a protocol error
        raise ProtocolError(f"undecodable control message: {e}") from e
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} != {PROTOCOL_VERSION}")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return _KINDS[kind](**body)
