"""One codec for every pdserve wire protocol: msgspec structs tagged by type, in msgpack, inside
a `[version, message]` envelope, followed by the envelope's XXH3-64 digest (8 bytes). Decoding
checks the digest, then every field's type, so whatever arrives either becomes one of the
protocol's messages or raises `ProtocolError`: nothing half-valid gets in, and no frame changed
on the way (a flipped bit, a cut tail) is read as another message (a block id, a token id)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Generic, TypeVar, Union

import msgspec
import xxhash

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=msgspec.Struct)

# Control frames are small (the longest is a prompt's token ids); anything larger is junk.
MAX_FRAME_BYTES = 16 << 20

DIGEST_BYTES = 8


def digest(data: bytes | memoryview) -> bytes:
    """The 8-byte digest a frame ends with."""
    return xxhash.xxh3_64_digest(data)


def seal(envelope: bytes) -> bytes:
    """A frame of any msgpack envelope: it followed by its digest."""
    return envelope + digest(envelope)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol and version."""


class Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    """Base of every wire message: a subclass names its tag, `class Abort(Message, tag="abort")`."""

    @property
    def TYPE(self) -> str:  # noqa: N802 - reads like the tag it is
        return type(self).__struct_config__.tag


class Codec(Generic[M]):
    """Encodes any message of `types`; decodes only those (a frame of another type is refused)."""

    def __init__(
        self, name: str, version: int, types: tuple[type[M], ...], max_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        self.name = name
        self.version = version
        self.types = types
        self.max_bytes = max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(tuple[int, Union[types]])  # noqa: UP007

    def encode(self, msg: M) -> bytes:
        return seal(self._encoder.encode((self.version, msg)))

    def decode(self, frame: bytes | memoryview) -> M:
        if len(frame) > self.max_bytes:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {self.max_bytes}")
        if len(frame) <= DIGEST_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes: too short for a message")
        view = memoryview(frame)
        frame, sent = view[:-DIGEST_BYTES], view[-DIGEST_BYTES:]
        if digest(frame) != sent:
            raise ProtocolError(self._explain_digest(view))
        try:
            version, msg = self._decoder.decode(frame)
        # (a string that is not UTF-8 raises UnicodeDecodeError, not DecodeError)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise ProtocolError(self._explain(frame, exc)) from None
        if version != self.version:
            raise ProtocolError(f"{self.name} protocol version {version}, expected {self.version}")
        return msg

    def decode_frames(self, frames: list) -> M:
        """The one message a multipart ZMQ message carries (after any routing id): exactly one
        frame, or ProtocolError."""
        if len(frames) != 1:
            raise ProtocolError(f"{len(frames)} frames, expected 1")
        return self.decode(frames[0])

    def _explain_digest(self, frame: memoryview) -> str:
        """Name another protocol version (an older release's frames end with no digest) rather
        than the digest it fails."""
        try:
            envelope: Any = msgspec.msgpack.decode(frame)
        except (msgspec.DecodeError, UnicodeDecodeError):
            envelope = None
        if isinstance(envelope, list) and len(envelope) == 2 and envelope[0] != self.version:
            return f"{self.name} protocol version {envelope[0]!r}, expected {self.version}"
        return f"a {self.name} frame whose digest does not match (cut or changed on the way)"

    def _explain(self, frame: bytes | memoryview, exc: Exception) -> str:
        """Name a wrong version rather than the field it trips on first."""
        try:
            envelope: Any = msgspec.msgpack.decode(frame)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return f"undecodable frame: {exc}"
        if isinstance(envelope, list) and len(envelope) == 2 and envelope[0] != self.version:
            return f"{self.name} protocol version {envelope[0]!r}, expected {self.version}"
        return f"not a {self.name} message: {exc}"


class MalformedLog:
    """Logs the first malformed frame (or refused connection) from each peer and counts the rest,
    so one bad peer cannot flood the log; a bounded number of peers is remembered (junk can come
    from many)."""

    def __init__(
        self,
        log: logging.Logger,
        where: str,
        max_peers: int = 1024,
        what: str = "a malformed message",
    ) -> None:
        self.log = log
        self.where = where
        self.what = what  # what is dropped: a malformed message, a connection
        self.max_peers = max_peers
        self.counts: OrderedDict[str, int] = OrderedDict()

    def __call__(self, peer: str, problem: str) -> None:
        count = self.counts.pop(peer, 0) + 1
        self.counts[peer] = count
        if len(self.counts) > self.max_peers:
            self.counts.popitem(last=False)
        if count == 1:
            self.log.warning(
                "%s: dropped %s from %s (%s); further ones from it are counted, not logged",
                self.where,
                self.what,
                peer,
                problem,
            )

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def peer_name(identity: bytes) -> str:
    """A ZMQ routing id as a log-safe string."""
    return identity.decode(errors="backslashreplace")[:80]
