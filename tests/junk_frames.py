"""Malformed ZMQ messages of every shape, for the tests that throw them at pdserve's ports."""

from __future__ import annotations

import msgpack

from pdserve.cluster.codec import MAX_FRAME_BYTES, seal
from pdserve.cluster.node_messages import NODE_PROTOCOL_VERSION, Abort, Heartbeat, orders, reports

V = NODE_PROTOCOL_VERSION
JUNK: list[list[bytes]] = [
    [b"\xc1 not msgpack"],
    [b"a", b"b", b"c"],  # several frames: this once stopped the coordinator serving
    [b""],
    [b"", b""],
    [b"\x00" * (MAX_FRAME_BYTES + 1)],  # over the codec's limit
    [seal(msgpack.packb([V, {"type": "heartbeat", "node_id": 5}]))],  # a wrong type
    [seal(msgpack.packb([V + 1, {"type": "shutdown"}]))],  # another protocol version
    [orders.encode(Abort("x"))],  # an order, sent the wrong way
    [reports.encode(Heartbeat("nobody", 1, 1, 0, 0, 0))],  # a valid report from a stranger
]
