"""Every message of the coordinator's two wire protocols (nodes, Python clients) survives encoding
and decoding field for field, with every field set away from its default; a message type added
without an example here fails the coverage test."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.cluster.client_messages import Cancel, Event, Submit, client_events, client_requests
from pdserve.cluster.codec import Codec, Message
from pdserve.cluster.node_messages import (
    Abort,
    Admit,
    Admitted,
    FinishReason,
    FirstToken,
    Generate,
    HandoffReady,
    Heartbeat,
    KVEventRecord,
    KVEventsAck,
    KVOp,
    KVTierReport,
    NodeRole,
    Prefill,
    Register,
    RequestError,
    Reset,
    SendKV,
    Shutdown,
    StartDecode,
    TokenItem,
    TokenLogprobs,
    Tokens,
    TransferDone,
    orders,
    reports,
)
from pdserve.cluster.sampling_params import SamplingParams

PARAMS = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=11,
    stop_token_ids=[2, 3],
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    logprobs=3,
)
LOGPROBS = TokenLogprobs(9, -0.25, [(9, -0.25), (4, -1.5)])
LAYOUT = {"num_layers": 2, "block_size": 8, "num_kv_heads": 2, "head_dim": 32, "dtype": "bf16"}
RECEIVER = {"transport": "tcp", "address": "tcp://10.0.0.3:5700", "num_blocks": 512}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # W3C's example

EXAMPLES: list[tuple[Codec, Message]] = [
    (
        reports,
        Register("d0", NodeRole.DECODE, "llama", 8, 512, 4096, "tcp", LAYOUT, RECEIVER, 42, 99),
    ),
    (
        reports,
        Heartbeat(
            "d0",
            100,
            512,
            3,
            4,
            900,
            12,
            5,
            2,
            77,
            "receiver thread failed",
            40,
            24,
            9,
            30,
            21,
            [9, 7, 5],
            2,
            99,
            [KVEventRecord(1, KVOp.CLEAR), KVEventRecord(2, KVOp.STORED, "host", bytes(32))],
            KVTierReport({"host": 5}, {"host": 2}, {"host": 4096}, {"host": 2048}, 1, 0.01, 0, {}),
            640,
            0x5EED,
            17,
            96,
            48,
            1 << 20,
            3 << 19,
        ),
    ),
    (reports, HandoffReady("p0")),
    (reports, FirstToken("r#1", 9, FinishReason.LENGTH, 16, 3, LOGPROBS)),
    (reports, Admitted("r#1", True, [5, 6, 7], 2)),
    (reports, TransferDone("r#1", False, "timed out")),
    (
        reports,
        Tokens("d0", [TokenItem("r#1", 9, FinishReason.STOP, LOGPROBS), TokenItem("q#0", 4)]),
    ),
    (reports, RequestError("r#1", "bad token", False)),
    (orders, Prefill("r#1", [1, 2, 3], PARAMS, 2, True, TRACEPARENT)),
    (orders, Generate("r#1", [1, 2, 3], PARAMS, 1, TRACEPARENT)),
    (orders, Admit("r#1", [1, 2, 3, 4], 3, PARAMS, 12.5, 1, True, True, TRACEPARENT)),
    (orders, SendKV("r#1", "d0", RECEIVER, [5, 6], 12.5, 2, True, TRACEPARENT)),
    (orders, StartDecode("r#1", 9)),
    (orders, Abort("r#1", True)),
    (orders, KVEventsAck(99, 12, True)),
    (orders, Shutdown()),
    (orders, Reset()),
    (client_requests, Submit("c-1", [1, 2, 3], PARAMS)),
    (client_requests, Cancel("c-1")),
    (client_events, Event("c-1", [9, 10], "length", [LOGPROBS], "boom", "internal", 3, 2)),
]


@pytest.mark.parametrize("codec,msg", EXAMPLES, ids=lambda x: getattr(x, "TYPE", ""))
def test_every_message_round_trips_field_for_field(codec, msg):
    decoded = codec.decode(codec.encode(msg))
    assert type(decoded) is type(msg)
    assert msgspec.structs.asdict(decoded) == msgspec.structs.asdict(msg)


@pytest.mark.parametrize("codec,msg", EXAMPLES, ids=lambda x: getattr(x, "TYPE", ""))
def test_every_example_sets_its_fields_away_from_their_defaults(codec, msg):
    for field in msgspec.structs.fields(msg):
        if field.default is not msgspec.NODEFAULT:
            assert getattr(msg, field.name) != field.default, f"{msg.TYPE}.{field.name}"
        if field.default_factory is not msgspec.NODEFAULT:  # e.g. an empty list
            assert getattr(msg, field.name) != field.default_factory(), f"{msg.TYPE}.{field.name}"


def test_every_message_type_has_an_example():
    covered = {type(msg) for _, msg in EXAMPLES}
    for codec in (reports, orders, client_requests, client_events):
        missing = [t.__name__ for t in codec.types if t not in covered]
        assert not missing, f"{codec.name} types without an example: {missing}"


@pytest.mark.parametrize("codec,msg", EXAMPLES, ids=lambda x: getattr(x, "TYPE", ""))
def test_a_message_is_refused_by_the_codecs_of_other_directions(codec, msg):
    for other in (reports, orders, client_requests, client_events):
        if other is not codec:
            with pytest.raises(ValueError):
                other.decode(codec.encode(msg))


def test_a_string_that_is_not_utf8_is_refused_as_junk():
    from pdserve.cluster.codec import ProtocolError
    from pdserve.cluster.node_messages import Abort, orders

    frame = orders.encode(Abort("req-abc")).replace(b"req-abc", b"req-\xc1bc")
    with pytest.raises(ProtocolError):
        orders.decode(frame)


def test_a_frame_cut_or_changed_on_the_way_is_refused_by_its_digest():
    from pdserve.cluster.codec import ProtocolError
    from pdserve.cluster.node_messages import TokenItem, Tokens, reports

    frame = reports.encode(Tokens("decode-0", [TokenItem("r#0", 1234)]))
    assert reports.decode(frame) == Tokens("decode-0", [TokenItem("r#0", 1234)])
    changed = frame.replace((1234).to_bytes(2, "big"), (1235).to_bytes(2, "big"))
    assert changed != frame  # still a valid message, with another token: the digest refuses it
    for bad in (changed, frame[:-1], frame[:-9] + frame[-8:]):
        with pytest.raises(ProtocolError, match="digest does not match"):
            reports.decode(bad)


def test_a_frame_of_an_older_release_is_refused_naming_its_version():
    import msgspec

    from pdserve.cluster.codec import ProtocolError
    from pdserve.cluster.node_messages import NODE_PROTOCOL_VERSION, Abort, orders

    old = msgspec.msgpack.encode((NODE_PROTOCOL_VERSION - 1, Abort("r")))  # no digest
    with pytest.raises(ProtocolError, match=f"version {NODE_PROTOCOL_VERSION - 1}, expected"):
        orders.decode(old)
