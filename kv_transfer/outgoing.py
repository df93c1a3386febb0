"""A send as the sender holds it from send() to its one TransferResult: its blocks, layers, heads,
deadline and where it stands; `SendFailed` ends one that cannot go on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class SendFailed(Exception):
    """A send cannot go on (peer gone, timeout); the message is the TransferResult error."""


class SendState(enum.Enum):
    QUEUED = "queued"  # push: waiting for its turn on the wire
    AWAITING_GO = "awaiting_go"  # direct: Begin sent, the receiver has not granted the write
    AWAITING_ACK = "awaiting_ack"  # all pages out (or written): the receiver confirms


@dataclass(slots=True)
class Outgoing:
    send_id: int
    transfer_id: str
    peer_id: str
    src_blocks: list[int]
    dst_blocks: list[int]
    layers: tuple[int, int]
    timeout_s: float
    deadline: float
    ready: Any = None  # CUDA event: the pages are computed (recorded on the caller's stream)
    state: SendState = SendState.QUEUED
    heads: tuple[int, int] | None = None  # the KV heads of our pages it sends (None: all)
    dst_heads: tuple[int, int] | None = None  # the receiver's heads they fill (None: all)
