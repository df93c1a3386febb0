"""Control messages between a KV sender and receiver, on the codec of every pdserve wire protocol
(`pdserve.cluster.codec`): typed structs, so a frame with a field of the wrong type or range is refused.

Sender to receiver: Hello, Pages (header of a chunk of pages that follows in the same ZMQ
message or over NCCL), Begin / Written / Done (a direct write into a mapped pool, chunk by
chunk), Abort.
Receiver to sender: Welcome / Refuse (handshake), Go (write now), Ack / Nack (per send), Ping.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from pdserve.cluster.codec import Codec, Message, ProtocolError
from pdserve.engine.kv.cache import KVLayout

# 2: msgspec structs in the cluster codec's [version, message] envelope; 3: head slices (`heads`);
# 4: page digests (`Hello.integrity`, `Pages.digest`, `Done.digest`)
KV_PROTOCOL_VERSION = 5  # 5: frames end with a digest
Digest = Annotated[int, Meta(ge=0)]  # 64 bits, unsigned

# Control frames hold block lists at most (a send's destination blocks); page bytes travel in
# frames of their own, so a larger control frame is junk.
MAX_CONTROL_BYTES = 4 << 20

Count = Annotated[int, Meta(ge=0)]
LayerRange = tuple[Count, Count]  # [start, end), not empty


def _check_range(what: str, rng: tuple[int, int]) -> None:
    if rng[0] >= rng[1]:
        raise ValueError(f"empty {what} range {list(rng)}")


class Hello(Message, tag="hello"):
    sender: str
    transport: str
    layout: KVLayout
    host: str
    pid: int
    integrity: str | None = None  # the digest its sends carry (kv_transfer.integrity); None: none


class Welcome(Message, tag="welcome"):
    extra: dict[str, Any] = {}  # what the transport hands over (e.g. NCCL's unique id)


class Refuse(Message, tag="refuse"):
    error: str


class Pages(Message, tag="pages"):
    """One chunk of a send: layers [layers) x dst[lo:hi] of that send, every plane of the layout
    (K and V, or MLA's latent alone).

    The first chunk of a send opens it (dst, send_layers, timeout_s set); the last one closes it.
    Its pages come as one gathered [layers, planes, n, ...] buffer, or, when `runs` is set
    (lengths of runs of consecutive source blocks), as one buffer per (layer, plane, run) in that
    order, sent straight from the sender's pool. `heads`: the KV heads [h0, h1) of the receiver's
    pages they fill (None: all; pages then hold h1 - h0 heads each).
    """

    transfer_id: str
    send_id: Count
    layers: LayerRange
    lo: Count
    hi: Count
    nbytes: Count
    first: bool
    last: bool
    dst: list[Count] | None = None
    send_layers: LayerRange | None = None
    timeout_s: float = 30.0
    runs: list[Annotated[int, Meta(gt=0)]] | None = None
    heads: LayerRange | None = None
    digest: Digest | None = None  # of this chunk's pages, by the Hello's integrity algorithm

    def __post_init__(self) -> None:  # runs at decode too: a ValueError refuses the frame
        _check_range("layer", self.layers)
        if self.heads is not None:
            _check_range("head", self.heads)
        if self.lo >= self.hi:
            raise ValueError(f"empty block slice [{self.lo}, {self.hi})")
        if self.first and (self.dst is None or self.send_layers is None):
            raise ValueError("the first chunk of a send names its dst blocks and layers")
        if self.send_layers is not None:
            _check_range("send layer", self.send_layers)


class Begin(Message, tag="begin"):
    """Ask to write layers x dst (KV heads `heads` of them; None: all) of a transfer straight
    into the receiver's (mapped) pool."""

    transfer_id: str
    send_id: Count
    layers: LayerRange
    dst: list[Count]
    timeout_s: float = 30.0
    heads: LayerRange | None = None

    def __post_init__(self) -> None:
        _check_range("layer", self.layers)
        if self.heads is not None:
            _check_range("head", self.heads)


class Go(Message, tag="go"):
    send_id: Count


class Written(Message, tag="written"):
    """A direct write's chunk is in the receiver's pool: layers x dst[lo:hi] of the send, with
    the digest of its source pages, which the receiver checks while the next chunk is written."""

    transfer_id: str
    send_id: Count
    layers: LayerRange
    lo: Count
    hi: Count
    digest: Digest

    def __post_init__(self) -> None:
        _check_range("layer", self.layers)
        if self.lo >= self.hi:
            raise ValueError(f"empty block slice [{self.lo}, {self.hi})")


class Done(Message, tag="done"):
    transfer_id: str
    send_id: Count
    digest: Digest | None = None  # of the send's source pages, by the Hello's algorithm


class Abort(Message, tag="abort"):
    transfer_id: str
    send_id: Count
    error: str


class Ack(Message, tag="ack"):
    transfer_id: str
    send_id: Count


class Nack(Message, tag="nack"):
    transfer_id: str
    send_id: Count
    error: str


class Ping(Message, tag="ping"):
    pass


ControlMessage = (
    Hello | Welcome | Refuse | Pages | Begin | Go | Written | Done | Abort | Ack | Nack | Ping
)

# Both directions on one codec: each side refuses what should not come its way when it handles it.
control: Codec[Message] = Codec(
    "kv control",
    KV_PROTOCOL_VERSION,
    (Hello, Welcome, Refuse, Pages, Begin, Go, Written, Done, Abort, Ack, Nack, Ping),
    max_bytes=MAX_CONTROL_BYTES,
)

__all__ = [
    "KV_PROTOCOL_VERSION",
    "MAX_CONTROL_BYTES",
    "Abort",
    "Ack",
    "Begin",
    "ControlMessage",
    "Done",
    "Go",
    "Hello",
    "Nack",
    "Pages",
    "Ping",
    "ProtocolError",
    "Refuse",
    "Welcome",
    "Written",
    "control",
]
