"""The KV control protocol on the cluster codec: every message survives the wire as it was sent
(from a ZMQ frame's memoryview too), and a frame with a field of the wrong type or range, from
another version, or too large, is refused before it reaches a transport."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from pdserve.cluster.codec import seal
from pdserve.engine.kv.cache import KVLayout
from pdserve.kv_transfer.protocol import (
    KV_PROTOCOL_VERSION,
    MAX_CONTROL_BYTES,
    Abort,
    Ack,
    Begin,
    Done,
    Go,
    Hello,
    Nack,
    Pages,
    Ping,
    ProtocolError,
    Refuse,
    Welcome,
    control,
)

LAYOUT = KVLayout(num_layers=4, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")

EVERY_MESSAGE = [
    Hello("prefill-0", "tcp", LAYOUT, "host-a", 4242),
    Welcome({"unique_id": b"\x00\x01" * 64}),
    Refuse("KV layout mismatch in field 'head_dim'"),
    Pages("t", 3, (0, 2), 0, 5, 1280, True, False, [9, 4, 7, 1, 0], (0, 4), 12.5),
    Pages("t", 3, (2, 4), 0, 5, 1280, False, True, runs=[2, 3]),
    Begin("t", 4, (1, 3), [2, 8], 30.0),
    Go(4),
    Done("t", 4),
    Abort("t", 4, "gather failed"),
    Ack("t", 3),
    Nack("t", 3, "refused"),
    Ping(),
]


def raw(message: dict[str, Any], version: int = KV_PROTOCOL_VERSION) -> bytes:
    """A frame as anyone could write it: any fields, any types."""
    return seal(msgspec.msgpack.encode([version, message]))


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: m.TYPE)
def test_every_message_decodes_to_what_was_sent_from_bytes_and_from_a_memoryview(msg) -> None:
    frame = control.encode(msg)
    assert control.decode(frame) == msg
    assert control.decode(memoryview(frame)) == msg


PAGES = {"type": "pages", "transfer_id": "t", "send_id": 1, "layers": [0, 1], "lo": 0, "hi": 1}
PAGES |= {"nbytes": 256, "first": True, "last": True, "dst": [3], "send_layers": [0, 1]}


@pytest.mark.parametrize(
    "frame, problem",
    [
        (raw({**PAGES, "dst": ["3"]}), "Expected `int`"),
        (raw({**PAGES, "send_id": 1.5}), "Expected `int`"),
        (raw({**PAGES, "layers": [0, 1, 2]}), "length 2"),
        (raw({**PAGES, "layers": [2, 2]}), "empty layer range"),
        (raw({**PAGES, "lo": -1}), ">= 0"),
        (raw({**PAGES, "lo": 1, "hi": 1}), "empty block slice"),
        (raw({**PAGES, "dst": None}), "names its dst blocks"),
        (raw({**PAGES, "runs": [2, 0]}), ">= 1"),
        (raw({**PAGES, "extra": 1}), "unknown field"),
        (
            raw(
                {
                    "type": "hello",
                    "sender": "s",
                    "transport": "tcp",
                    "layout": {},
                    "host": "h",
                    "pid": 1,
                }
            ),
            "missing required field",
        ),
        (raw({"type": "go", "send_id": "1"}), "Expected `int`"),
        (raw({"type": "shutdown"}), "Invalid value 'shutdown'"),
        (raw({"type": "ping"}, version=1), f"version 1, expected {KV_PROTOCOL_VERSION}"),
        # what a version-1 peer sent: a msgpack map with its version inside
        (seal(msgspec.msgpack.encode({"v": 1, "kind": "ping"})), "not a kv control message"),
        (seal(b"\xc1"), "undecodable"),
        (seal(b""), "too short"),
        (b"\xc1" * 20, "digest does not match"),
        (raw({"type": "ping"})[:-1], "digest does not match"),
        (b"\x00" * (MAX_CONTROL_BYTES + 1), "exceeds"),
    ],
)
def test_frames_with_wrong_types_versions_or_sizes_are_refused(frame: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(problem)):
        control.decode(memoryview(frame))
