"""The wire protocol between the coordinator and the nodes: msgpack maps with a version and a
type, each type a dataclass with explicit fields. The only thing nodes and coordinator share.

It lives in `engine` because both sides import it and code flows one way (nodes and
coordinator depend on engine, never on each other).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack

PROTOCOL_VERSION = 1
logger = logging.getLogger(__name__)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


@dataclass
class Message:
    TYPE: ClassVar[str] = ""


# --- node -> coordinator ---------------------------------------------------------------------


@dataclass
class Register(Message):
    TYPE: ClassVar[str] = "register"
    node_id: str
    role: str  # "prefill" | "decode" | "colocated"
    model: str
    kv_layout: dict
    num_blocks: int
    max_model_len: int
    transport: str
    receiver_info: dict = field(default_factory=dict)  # decode nodes: what senders connect to
    pid: int = 0


@dataclass
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    node_id: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    prefix_hits: int = 0
    prefix_misses: int = 0
    pending_transfers: int = 0
    seq: int = 0  # increases with each new load snapshot; a resend repeats it


@dataclass
class HandoffReady(Message):
    """From a prefill node's handoff socket: send SendKV here, where a thread starts the send
    at once instead of after the node's current step."""

    TYPE: ClassVar[str] = "handoff_ready"
    node_id: str


@dataclass
class FirstToken(Message):
    """Prefill done and the first token sampled; its KV waits for admission to a decode node."""

    TYPE: ClassVar[str] = "first_token"
    request_id: str
    token_id: int
    finish_reason: str | None  # None or "prefilled": decode continues; "stop"/"length": done
    num_cached_tokens: int
    num_blocks: int  # blocks the decode node needs for the prefilled KV
    logprobs: dict | None = None


@dataclass
class Admitted(Message):
    """A decode node reserved destination blocks (or could not: ok=False)."""

    TYPE: ClassVar[str] = "admitted"
    request_id: str
    ok: bool
    dst_blocks: list[int] = field(default_factory=list)


@dataclass
class TransferDone(Message):
    """Either side reports how a KV handoff ended."""

    TYPE: ClassVar[str] = "transfer_done"
    request_id: str
    ok: bool
    error: str | None = None


@dataclass
class Tokens(Message):
    """All new tokens of one decode step: items of [request_id, token_id, finish_reason,
    logprobs]."""

    TYPE: ClassVar[str] = "tokens"
    node_id: str
    items: list[list] = field(default_factory=list)


@dataclass
class RequestError(Message):
    TYPE: ClassVar[str] = "error"
    request_id: str
    message: str
    retryable: bool = True


# --- coordinator -> node ---------------------------------------------------------------------


@dataclass
class Prefill(Message):
    """Prefill these tokens (and keep the KV for a handoff)."""

    TYPE: ClassVar[str] = "prefill"
    request_id: str
    token_ids: list[int]
    params: dict
    generator_offset: int = 0  # random draws already used by this request (seeded)


@dataclass
class Generate(Message):
    """Run the whole request here (colocated, or conditional disaggregation)."""

    TYPE: ClassVar[str] = "generate"
    request_id: str
    token_ids: list[int]
    params: dict
    generator_offset: int = 0  # random draws already used by this request (seeded)


@dataclass
class Admit(Message):
    """Reserve blocks for a prefilled sequence whose KV will arrive from a prefill node."""

    TYPE: ClassVar[str] = "admit"
    request_id: str
    token_ids: list[int]  # prompt + first token
    num_computed: int  # tokens whose KV is transferred (the prompt)
    params: dict
    generator_offset: int = 0


@dataclass
class SendKV(Message):
    """Ship a prefilled sequence's KV to a decode node's reserved blocks."""

    TYPE: ClassVar[str] = "send_kv"
    request_id: str
    decode_node: str
    receiver_info: dict
    dst_blocks: list[int]


@dataclass
class Abort(Message):
    TYPE: ClassVar[str] = "abort"
    request_id: str
    # To a decode node that reserved blocks for this request's KV: no sender was ever asked to
    # send it, so the reservation can go at once instead of waiting for a transfer to land.
    kv_unsent: bool = False


@dataclass
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"


@dataclass
class Reset(Message):
    """The coordinator declared this node dead and moved its requests: drop them all and
    register again."""

    TYPE: ClassVar[str] = "reset"


# --- client <-> coordinator (the Python client) ---------------------------------------------


@dataclass
class Submit(Message):
    TYPE: ClassVar[str] = "submit"
    request_id: str
    token_ids: list[int]
    params: dict


@dataclass
class Event(Message):
    """Tokens for a client's request, or its end (finish_reason), or an error."""

    TYPE: ClassVar[str] = "event"
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    error: str | None = None
    error_code: str | None = None  # "overloaded" | "unavailable" | "invalid" | "internal"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Register, Heartbeat, HandoffReady, FirstToken, Admitted, TransferDone, Tokens, RequestError,
        Prefill, Generate, Admit, SendKV, Abort, Shutdown, Reset, Submit, Event,
    )
}  # fmt: skip


def encode(msg: Message) -> bytes:
    body = dataclasses.asdict(msg)
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Parse one frame; raises ProtocolError for anything not a valid message."""
    try:
        body = msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError("frame is not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(body.pop("type", None))
    if cls is None:
        raise ProtocolError("unknown message type")
    try:
        return cls(**body)
    except TypeError as exc:
        raise ProtocolError(f"bad fields for {cls.TYPE}: {exc}") from exc


def decode_or_log(frame: bytes, source: str = "") -> Message | None:
    """For receive loops: a malformed message is logged and dropped, never raised."""
    try:
        return decode(frame)
    except ProtocolError as exc:
        logger.warning("dropped malformed message from %s: %s", source or "peer", exc)
        return None
