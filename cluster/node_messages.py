"""The wire protocol between the coordinator and its nodes: each message a struct with explicit,
typed fields. Nodes decode only what the coordinator sends, and the coordinator only what nodes
send, so a message going the wrong way is refused like any other malformed frame."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pdserve.cluster.codec import Codec, Message
from pdserve.cluster.sampling_params import SamplingParams

NODE_PROTOCOL_VERSION = 6  # 3: frames end with a digest; 4: KV event streams; 5: load reports;
# 6: KV bytes moved
# carry their link fence (link_session, link_sent) and a draft model's catch-up counts


class NodeRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # both phases in one engine

    @property
    def decodes(self) -> bool:
        return self is not NodeRole.PREFILL


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens or the context is used up
    ABORT = "abort"  # ended by the coordinator or the node


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The sampled token's logprob and the `top` most likely tokens', as (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class KVOp(enum.StrEnum):
    CLEAR = "clear"  # the node's view restarts: every tier empty (a snapshot follows)
    STORED = "stored"  # the blocks entered the tier
    REMOVED = "removed"  # the blocks left it


class KVEventRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One numbered batch of a node's KV event stream (`cluster/kv_event_stream.py`): blocks of
    one tier entering or leaving it, by chained hash, each 16 bytes little-endian, concatenated
    (128-bit hashes do not fit msgpack's integers)."""

    seq: int  # consecutive within the stream, from 1
    op: KVOp
    tier: str = ""  # "device", "host" or "disk" ("" with CLEAR)
    hashes: bytes = b""


class TokenItem(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sequence's new token in a decode step."""

    request_id: str
    token_id: int
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None


class KVTierReport(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A node's KV tiers below its pool (since it started), each dict keyed by tier ("host",
    "disk"): blocks found and not found when a prompt's prefix was looked up past the pool,
    bytes written down and loaded back, loads and their time, failed copies, blocks held now."""

    hit_blocks: dict[str, int] = {}
    miss_blocks: dict[str, int] = {}
    written_bytes: dict[str, int] = {}
    loaded_bytes: dict[str, int] = {}
    loads: int = 0
    load_seconds: float = 0.0
    failures: int = 0
    blocks: dict[str, int] = {}


# --- node -> coordinator -------------------------------------------------------------------------


class Register(Message, tag="register"):
    node_id: str
    role: NodeRole
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    transport: str  # what its KV receiver speaks ("none" for a node that receives no KV)
    kv_layout: dict[str, Any] = {}
    receiver_info: dict[str, Any] = {}  # decode nodes: what senders connect to
    pid: int = 0
    kv_stream: int = 0  # its KV event stream from now on (0: it publishes none)


class Heartbeat(Message, tag="heartbeat"):
    """A node's load, from its heartbeat socket; a resent snapshot repeats its `seq`."""

    node_id: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    prefix_hits: int = 0
    prefix_misses: int = 0
    pending_transfers: int = 0
    seq: int = 0
    kv_error: str | None = None  # the node's KV transport failed: route no handoffs to it
    kv_blocks_received: int = 0  # decode nodes: blocks whose pages arrived (since start)
    kv_blocks_reused: int = 0  # decode nodes: blocks of admitted prompts found already cached
    forced_tokens: int = 0  # output tokens its constraints forced, appended without a step
    # Speculative decoding (since start): draft tokens verified, accepted, and accepted by
    # position (index j: the j+1-th draft of a step)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    kv_integrity_failures: int = 0  # decode nodes: sends whose pages failed their digest check
    # Its KV event stream (the one its registration named) and the records of it not yet
    # acknowledged, oldest first, a bounded number of hashes per report.
    kv_stream: int = 0
    kv_events: list[KVEventRecord] = []
    kv_tiers: KVTierReport | None = None  # its KV tiers below the pool, if it has any
    prefill_tokens_computed: int = 0  # prompt tokens whose KV its steps computed (since start)
    # Its main link's session and how many messages it had sent there when the snapshot was
    # taken: a snapshot whose count reaches a message the coordinator received postdates it.
    link_session: int = 0
    link_sent: int = 0
    # A draft model's tokens (since start): computed to catch its KV up, and found in its cache
    spec_draft_catch_up_tokens: int = 0
    spec_draft_cached_tokens: int = 0
    # KV pages' bytes its handoffs moved (since start): prefill nodes sent, decode nodes received
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0


class HandoffReady(Message, tag="handoff_ready"):
    """From a prefill node's handoff socket: send SendKV here, where a thread starts the send
    at once instead of after the node's current step."""

    node_id: str


class FirstToken(Message, tag="first_token"):
    """Prefill done and the first token sampled. With no finish reason, the node holds the KV
    (num_blocks of it) for a handoff to the decode node the coordinator admits it to."""

    request_id: str
    token_id: int
    finish_reason: FinishReason | None
    num_cached_tokens: int
    num_blocks: int
    logprobs: TokenLogprobs | None = None


class Admitted(Message, tag="admitted"):
    """A decode node reserved destination blocks (or could not: ok=False). With prefix reuse,
    the first num_reused blocks of the prompt were already cached there: dst_blocks are for the
    blocks after them."""

    request_id: str
    ok: bool
    dst_blocks: list[int] = []
    num_reused: int = 0


class TransferDone(Message, tag="transfer_done"):
    """Either side reports how a KV handoff ended."""

    request_id: str
    ok: bool
    error: str | None = None


class Tokens(Message, tag="tokens"):
    """All new tokens of one decode step."""

    node_id: str
    items: list[TokenItem] = []


class RequestError(Message, tag="error"):
    request_id: str
    message: str
    retryable: bool = True


# --- coordinator -> node -------------------------------------------------------------------------


class Prefill(Message, tag="prefill"):
    """Prefill these tokens, sample the first token, and hold the KV for a handoff."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    # Outputs of this request sampled before token_ids' end (a retry resumes from them): seeded
    # sampling continues the same stream from there.
    output_offset: int = 0
    # Layer-wise KV streaming: a decode node is being admitted while this prefill runs; its
    # SendKV may come before the first token, and the last chunk's forward then hands each
    # layer's pages to the transport as soon as that layer is done.
    stream_kv: bool = False
    # W3C traceparent of the coordinator's span this order hangs from ("": not traced): the
    # node's spans of the work it starts are its children.
    trace_context: str = ""


class Generate(Message, tag="generate"):
    """Run the whole request here (colocated, or conditional disaggregation)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    output_offset: int = 0
    trace_context: str = ""  # as Prefill's


class Admit(Message, tag="admit"):
    """Reserve blocks for a prefilled sequence whose KV will arrive from a prefill node."""

    request_id: str
    token_ids: list[int]  # prompt + the outputs so far
    num_computed: int  # tokens whose KV is transferred (all but the last)
    params: SamplingParams
    transfer_timeout_s: float  # the coordinator's setting when it admitted the sequence
    output_offset: int = 0  # outputs before token_ids[num_computed:]
    # Take the leading full blocks the node's prefix cache already holds; receive only the rest.
    reuse_prefix: bool = False
    # Early admission (layer-wise KV streaming): sent when the prefill starts, before the first
    # token exists. token_ids is then the prefill's tokens alone, num_computed all of them, and
    # the first token comes later in a `StartDecode`; the sequence runs once both that token
    # and every layer of its KV are in. transfer_timeout_s then covers the prefill too.
    first_token_pending: bool = False
    trace_context: str = ""  # as Prefill's


class SendKV(Message, tag="send_kv"):
    """Ship a prefilled sequence's KV to a decode node's reserved blocks."""

    request_id: str
    decode_node: str
    receiver_info: dict[str, Any]
    dst_blocks: list[int]
    transfer_timeout_s: float
    skip_blocks: int = 0  # leading blocks the decode node holds already: not sent
    # Sent while the prefill runs (early admission): it may overtake the Prefill order (it goes
    # to the handoff socket), so the prefill node keeps the route until that order comes.
    prefilling: bool = False
    trace_context: str = ""  # as Prefill's


class StartDecode(Message, tag="start_decode"):
    """The first token of a sequence admitted before its prefill ended (`Admit` with
    first_token_pending): the decode node appends it and runs the sequence once its KV is in."""

    request_id: str
    token_id: int


class Abort(Message, tag="abort"):
    request_id: str
    # To a decode node that reserved blocks for this request's KV: no sender was ever asked to
    # send it, so the reservation can go at once instead of waiting for a transfer to land.
    kv_unsent: bool = False


class KVEventsAck(Message, tag="kv_events_ack"):
    """The coordinator's index applied the node's KV event stream up to `seq`; with `resync`
    it lost its place (a record it never got) and wants a snapshot of the node's tiers."""

    stream: int
    seq: int
    resync: bool = False


class Shutdown(Message, tag="shutdown"):
    pass


class Reset(Message, tag="reset"):
    """The coordinator declared this node dead and moved its requests: drop them all and
    register again."""


NodeReport = (
    Register
    | Heartbeat
    | HandoffReady
    | FirstToken
    | Admitted
    | TransferDone
    | Tokens
    | RequestError
)
NodeOrder = (
    Prefill | Generate | Admit | SendKV | StartDecode | Abort | KVEventsAck | Shutdown | Reset
)

NODE_REPORTS: tuple[type[Message], ...] = (
    Register,
    Heartbeat,
    HandoffReady,
    FirstToken,
    Admitted,
    TransferDone,
    Tokens,
    RequestError,
)
NODE_ORDERS: tuple[type[Message], ...] = (
    Prefill,
    Generate,
    Admit,
    SendKV,
    StartDecode,
    Abort,
    KVEventsAck,
    Shutdown,
    Reset,
)

# What the coordinator decodes, and what a node decodes.
reports = Codec("node report", NODE_PROTOCOL_VERSION, NODE_REPORTS)
orders = Codec("node order", NODE_PROTOCOL_VERSION, NODE_ORDERS)
