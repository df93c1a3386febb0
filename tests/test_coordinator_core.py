"""The coordinator's core under a simulated clock: no sockets, no sleeps. Each test plays the
nodes' side of the protocol by hand and checks the orders and events the core answers with."""

from __future__ import annotations

import pytest

from pdserve.cluster.block_hash import prefix_hashes
from pdserve.cluster.client_messages import Event
from pdserve.cluster.kv_event_stream import pack_hashes
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
    KVOp,
    Message,
    NodeRole,
    Prefill,
    Register,
    RequestError,
    Reset,
    SendKV,
    TokenItem,
    Tokens,
    TransferDone,
)
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.core import CoordinatorCore, Outbox, SubmitError
from pdserve.coordinator.request_state import Phase, RequestState

BLOCK = 4
PROMPT = list(range(10, 22))  # 12 tokens: 3 blocks


class Sim:
    """A core, a clock, and what the core sent (orders by node identity, events by request)."""

    def __init__(self, **config: object) -> None:
        config.setdefault("heartbeat_timeout_s", 3.0)
        config.setdefault("transfer_timeout_s", 10.0)
        self.core = CoordinatorCore(CoordinatorConfig(**config))
        self.now = 100.0
        self.orders: list[tuple[bytes, Message]] = []
        self.events: list[Event] = []
        self.seq: dict[str, int] = {}
        self.kv_seq: dict[str, tuple[int, int]] = {}  # node -> (its KV event stream, last seq)
        self.checked: list[bytes] = []  # node sockets whose connection the core had checked
        self.unreachable: set[str] = set()  # node sockets with no connection (as the shell finds)

    def take(self, out: Outbox) -> None:
        self.orders += out.orders
        self.events += out.events
        for identity in out.connection_checks:  # what the shell does with them
            self.checked.append(identity)
            if identity.decode() in self.unreachable:
                self.take(self.core.on_unreachable(identity, self.now))

    def register(self, node_id: str, role: NodeRole, num_blocks: int = 64) -> None:
        info = {"transport": "tcp", "address": "tcp://127.0.0.1:1"} if role.decodes else {}
        stream = 1000 + len(self.kv_seq)  # its KV event stream
        msg = Register(node_id, role, "m", BLOCK, num_blocks, 1024, "tcp", receiver_info=info)
        msg.kv_stream = stream
        self.kv_seq[node_id] = (stream, 0)
        self.report(node_id, msg)
        self.heartbeat(node_id, free=num_blocks, total=num_blocks)

    def heartbeat(
        self,
        node_id: str,
        free: int = 64,
        total: int = 64,
        kv_error: str | None = None,
        kv_events: list[KVEventRecord] | None = None,
    ) -> None:
        self.seq[node_id] = self.seq.get(node_id, 0) + 1
        beat = Heartbeat(node_id, free, total, 0, 0, 0, seq=self.seq[node_id], kv_error=kv_error)
        if kv_events:
            beat.kv_stream, beat.kv_events = self.kv_seq[node_id][0], kv_events
        self.take(self.core.on_node_message(f"{node_id}/heartbeat".encode(), beat, self.now))

    def cache(
        self, node_id: str, token_ids: list[int], tier: str = "device", stored: bool = True
    ) -> None:
        """The node reports (in its KV events) the full blocks of token_ids entering (or
        leaving) a tier, with its load unchanged."""
        stream, seq = self.kv_seq[node_id]
        self.kv_seq[node_id] = (stream, seq + 1)
        op = KVOp.STORED if stored else KVOp.REMOVED
        record = KVEventRecord(seq + 1, op, tier, pack_hashes(prefix_hashes(token_ids, BLOCK)))
        node = self.core.nodes.nodes[node_id]
        self.heartbeat(node_id, node.free_blocks, node.num_blocks, kv_events=[record])

    def report(self, node_id: str, msg: Message) -> None:
        self.take(self.core.on_node_message(node_id.encode(), msg, self.now))

    def tick(self, seconds: float, alive: tuple[str, ...] = ()) -> None:
        """Let time pass in ticks of 0.1 s; the nodes in `alive` keep sending heartbeats."""
        for _ in range(round(seconds / 0.1)):
            self.now += 0.1
            for node_id in alive:
                self.heartbeat(node_id)
            self.take(self.core.on_tick(self.now))

    def submit(self, max_tokens: int = 4, prompt: list[int] = PROMPT, **kw) -> RequestState:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
        state, out = self.core.submit(prompt, params, self.now)
        self.take(out)
        return state

    def sent(self, kind: type, to: str | None = None) -> list[Message]:
        """Take the orders of one kind (to one socket) sent so far, in order."""
        found = [
            (i, m)
            for i, m in self.orders
            if isinstance(m, kind) and (to is None or i == to.encode())
        ]
        self.orders = [
            o
            for o in self.orders
            if not (isinstance(o[1], kind) and (to is None or o[0] == to.encode()))
        ]
        return [m for _, m in found]

    def prefill_to_first_token(self, state: RequestState, node: str = "p0") -> Prefill:
        """The node prefilled the request's current attempt: first token 99, KV in 4 blocks."""
        (prefill,) = [m for m in self.sent(Prefill, node) if m.request_id == state.wire_id]
        self.report(node, FirstToken(prefill.request_id, 99, None, 0, num_blocks=4))
        return prefill


def cluster(**config: object) -> Sim:
    sim = Sim(**config)
    sim.register("p0", NodeRole.PREFILL)
    sim.register("d0", NodeRole.DECODE)
    return sim


def test_a_request_goes_prefill_admission_handoff_decode():
    sim = cluster()
    sim.report("p0/handoff", HandoffReady("p0"))
    state = sim.submit(max_tokens=3)
    (prefill,) = sim.sent(Prefill, "p0")
    assert prefill.token_ids == PROMPT and prefill.output_offset == 0
    sim.report("p0", FirstToken(prefill.request_id, 50, None, 2, num_blocks=4))
    assert [e.token_ids for e in sim.events] == [[50]] and sim.events[0].num_cached_tokens == 2
    (admit,) = sim.sent(Admit, "d0")
    assert admit.token_ids == PROMPT + [50] and admit.num_computed == len(PROMPT)
    assert admit.params.max_tokens == 3 and admit.output_offset == 0
    assert admit.transfer_timeout_s == 10.0 and state.phase is Phase.ADMITTING
    sim.report("d0", Admitted(admit.request_id, True, [7, 8, 9, 10]))
    (send,) = sim.sent(SendKV, "p0/handoff")  # to the socket whose thread starts it at once
    assert send.dst_blocks == [7, 8, 9, 10] and send.decode_node == "d0"
    sim.report("p0", TransferDone(send.request_id, True))
    assert state.phase is Phase.DECODING
    sim.report("d0", Tokens("d0", [TokenItem(admit.request_id, 51)]))
    sim.report("d0", Tokens("d0", [TokenItem(admit.request_id, 52, FinishReason.LENGTH)]))
    assert [t for e in sim.events for t in e.token_ids] == [50, 51, 52]
    assert sim.events[-1].finish_reason == "length" and not sim.core.requests
    assert sim.orders == []  # nothing else was sent


def test_short_prompts_are_generated_on_the_decode_node():
    sim = cluster(conditional_disagg_threshold=20)
    sim.submit(prompt=[5, 6, 7])
    (generate,) = sim.sent(Generate, "d0")
    assert generate.token_ids == [5, 6, 7] and not sim.sent(Prefill)


def test_a_dead_prefill_node_s_request_is_prefilled_on_another():
    sim = cluster()
    sim.register("p1", NodeRole.PREFILL)
    state = sim.submit()
    (first,) = sim.sent(Prefill)
    victim = state.prefill_node
    other = "p1" if victim == "p0" else "p0"
    sim.tick(3.5, alive=(other, "d0"))  # the victim goes silent past the heartbeat timeout
    (retry,) = sim.sent(Prefill, other)
    assert retry.token_ids == PROMPT and retry.request_id != first.request_id
    assert state.attempt == 1 and state.prefill_node == other
    assert sim.orders == []  # nothing was sent to the dead node
    # Its late first token (it was only slow) is a stale attempt: its KV is freed.
    sim.report(victim, Register(victim, NodeRole.PREFILL, "m", BLOCK, 64, 1024, "tcp"))
    sim.report(victim, FirstToken(first.request_id, 9, None, 0, num_blocks=4))
    assert [m.request_id for m in sim.sent(Abort, victim)] == [first.request_id]
    assert sim.events == []


def test_a_request_fails_once_its_retries_are_used_up():
    sim = cluster(max_retries=1)
    state = sim.submit()
    for attempt in range(2):
        (prefill,) = sim.sent(Prefill, "p0")
        assert prefill.request_id == f"{state.request_id}#{attempt}"
        sim.report("p0", RequestError(prefill.request_id, "out of memory", retryable=True))
    (event,) = sim.events
    assert event.error_code == "unavailable" and "after 1 retries" in event.error
    assert not sim.core.requests and not sim.sent(Prefill)


def test_a_non_retryable_error_fails_the_request_and_frees_it_everywhere():
    sim = cluster()
    state = sim.submit()
    (prefill,) = sim.sent(Prefill, "p0")
    sim.report("p0", RequestError(prefill.request_id, "token id out of range", retryable=False))
    assert sim.events[-1].error_code == "invalid" and state.done
    assert [m.request_id for m in sim.sent(Abort, "p0")] == [prefill.request_id]


def test_a_refused_admission_goes_first_in_line_after_the_node_s_next_report():
    sim = cluster()
    first, second, third = sim.submit(), sim.submit(), sim.submit()
    sim.heartbeat("d0", free=12)  # room for two 4-block sequences above the watermark
    for prefill in sim.sent(Prefill, "p0"):
        sim.report("p0", FirstToken(prefill.request_id, 99, None, 0, num_blocks=4))
    admits = sim.sent(Admit, "d0")
    assert [a.request_id for a in admits] == [first.wire_id, second.wire_id]
    assert third.phase is Phase.WAITING_ADMISSION
    # The node had less room than it reported: the first is refused, the second taken.
    sim.report("d0", Admitted(first.wire_id, False))
    sim.report("d0", Admitted(second.wire_id, True, [1, 2, 3, 4]))
    assert first.phase is Phase.WAITING_ADMISSION and second.phase is Phase.TRANSFERRING
    sim.tick(0.5)  # no fresh report: nothing is admitted on the old one
    assert sim.sent(Admit) == []
    sim.heartbeat("d0", free=60)
    # The refused one goes before the one that was behind it all along.
    assert [a.request_id for a in sim.sent(Admit, "d0")] == [first.wire_id, third.wire_id]


def test_the_coordinator_ends_a_handoff_that_no_node_reports_on():
    sim = cluster(max_retries=2)
    state = sim.submit()
    sim.prefill_to_first_token(state)
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, [1, 2, 3, 4]))
    (send,) = sim.sent(SendKV, "p0")
    # Both nodes stay alive but neither ever reports the transfer's end.
    sim.tick(10.0 + 2.8, alive=("p0", "d0"))
    assert state.phase is Phase.TRANSFERRING and sim.sent(Abort) == []
    sim.tick(0.5, alive=("p0", "d0"))
    assert {m.request_id for m in sim.sent(Abort)} == {send.request_id}
    (retry,) = sim.sent(Prefill, "p0")
    assert retry.token_ids == PROMPT + [99] and retry.output_offset == 1
    assert state.attempt == 1


def test_a_request_past_request_timeout_s_fails_with_a_timeout_and_is_freed_everywhere():
    sim = cluster(request_timeout_s=30.0)
    state = sim.submit(max_tokens=1000)
    sim.prefill_to_first_token(state)
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, [1, 2, 3, 4]))
    sim.report("p0", TransferDone(admit.request_id, True))
    sim.tick(29.5, alive=("p0", "d0"))  # decoding, slowly: nothing ends it before its time
    assert not state.done and [e.error for e in sim.events if e.error] == []
    sim.tick(1.0, alive=("p0", "d0"))
    assert state.done and not sim.core.requests
    assert sim.events[-1].error_code == "timeout" and "within 30s" in sim.events[-1].error
    assert {m.request_id for m in sim.sent(Abort, "d0")} == {admit.request_id}


def decoding_on_d0(sim: Sim) -> RequestState:
    state = sim.submit(max_tokens=1000)
    sim.prefill_to_first_token(state)
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, [1, 2, 3, 4]))
    sim.report("p0", TransferDone(admit.request_id, True))
    assert state.phase is Phase.DECODING
    return state


def test_a_node_whose_connection_closes_for_good_is_dead_after_the_grace_alone():
    sim = cluster(heartbeat_timeout_s=60.0, disconnect_grace_s=0.5, max_retries=2)
    sim.register("d1", NodeRole.DECODE)
    state = decoding_on_d0(sim)
    sim.unreachable.add("d0")  # its process died: its sockets closed, and stay closed
    for socket in (b"d0", b"d0/heartbeat"):
        sim.take(sim.core.on_connection_closed(socket, sim.now))
    sim.tick(0.4, alive=("p0", "d1"))
    assert sim.core.nodes.nodes["d0"].alive and sim.checked == []
    sim.tick(0.2, alive=("p0", "d1"))
    assert sim.checked == [b"d0"]  # d0's main socket alone: no other connection closed
    assert not sim.core.nodes.nodes["d0"].alive
    assert sim.core.nodes.nodes["p0"].alive and sim.core.nodes.nodes["d1"].alive
    (retry,) = sim.sent(Prefill, "p0")  # moved at once: 0.5 s, not heartbeat_timeout_s
    assert retry.request_id == f"{state.request_id}#1"


def test_a_node_connected_again_within_the_grace_stays_alive():
    sim = cluster(heartbeat_timeout_s=60.0, disconnect_grace_s=0.5)
    state = decoding_on_d0(sim)
    # Its connection was reset: ZeroMQ makes it again within 0.1 s, and the check finds it.
    sim.take(sim.core.on_connection_closed(b"d0", sim.now))
    sim.tick(0.3)
    sim.take(sim.core.on_connection_closed(b"d0", sim.now))  # again: its check is put off
    sim.tick(0.4)
    assert sim.checked == []
    sim.tick(0.2)
    assert sim.checked == [b"d0"] and sim.core.nodes.nodes["d0"].alive
    sim.tick(2.0)  # checked once, and silent or not, alive until heartbeat_timeout_s
    assert sim.checked == [b"d0"] and sim.core.nodes.nodes["d0"].alive
    assert state.phase is Phase.DECODING and not sim.sent(Prefill)


def test_a_close_of_unknown_owner_has_every_node_checked_but_one_awaiting_its_own():
    sim = cluster(heartbeat_timeout_s=60.0, disconnect_grace_s=0.5)
    sim.register("d1", NodeRole.DECODE)
    sim.unreachable.add("d0")  # its main socket's connection, remade since, carried nothing
    sim.take(sim.core.on_connection_closed(None, sim.now))
    sim.tick(0.3)
    sim.take(sim.core.on_connection_closed(b"d1", sim.now))  # its own check is 0.5 s on
    sim.tick(0.3)
    assert sorted(sim.checked) == [b"d0", b"p0"]
    assert not sim.core.nodes.nodes["d0"].alive and sim.core.nodes.nodes["d1"].alive
    sim.tick(0.3)
    assert sorted(sim.checked) == [b"d0", b"d1", b"p0"] and sim.core.nodes.nodes["d1"].alive


def test_an_undeliverable_send_kv_goes_to_the_prefill_node_s_main_socket():
    sim = cluster()
    sim.report("p0/handoff", HandoffReady("p0"))
    state = sim.submit()
    sim.prefill_to_first_token(state)
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, [1, 2, 3, 4]))
    (send,) = sim.sent(SendKV, "p0/handoff")
    sim.take(sim.core.on_undeliverable(b"p0/handoff", send, sim.now))
    assert sim.sent(SendKV, "p0") == [send]
    assert "p0" not in sim.core.handoff_identities  # later ones go straight there


def test_a_decode_node_whose_kv_receiver_failed_is_admitted_nothing():
    sim = cluster()
    sim.register("d1", NodeRole.DECODE, num_blocks=32)  # less room: d0 would be preferred
    sim.heartbeat("d0", kv_error="tcp receiver thread failed")
    state = sim.submit()
    sim.prefill_to_first_token(state)
    assert [(a.request_id) for a in sim.sent(Admit, "d1")] == [state.wire_id]
    assert sim.core.ready()


def test_transfer_timeout_is_read_at_each_handoff():
    sim = cluster()
    state = sim.submit()
    sim.core.config.transfer_timeout_s = 4.0  # as a SIGHUP reload does
    sim.prefill_to_first_token(state)
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, [1, 2, 3, 4]))
    (send,) = sim.sent(SendKV, "p0")
    assert admit.transfer_timeout_s == 4.0 and send.transfer_timeout_s == 4.0


def test_a_retry_after_streamed_tokens_resumes_from_them():
    sim = cluster()
    sim.register("d1", NodeRole.DECODE)
    state = sim.submit(max_tokens=10, seed=5)
    sim.prefill_to_first_token(state)
    (admit,) = sim.sent(Admit)
    decoder = state.decode_node
    sim.report(decoder, Admitted(admit.request_id, True, [1, 2, 3, 4]))
    sim.report("p0", TransferDone(admit.request_id, True))
    sim.report(decoder, Tokens(decoder, [TokenItem(admit.request_id, 100)]))
    sim.report(decoder, Tokens(decoder, [TokenItem(admit.request_id, 101)]))
    other = "d1" if decoder == "d0" else "d0"
    sim.tick(3.5, alive=("p0", other))  # the decode node dies mid-stream
    (retry,) = sim.sent(Prefill, "p0")
    assert retry.token_ids == PROMPT + [99, 100, 101]
    assert retry.output_offset == 3 and retry.params.max_tokens == 7
    sim.report("p0", FirstToken(retry.request_id, 102, None, 0, num_blocks=4))
    (admit,) = sim.sent(Admit, other)
    # The decode node counts the newest token as its own output: 3 came before it.
    assert admit.output_offset == 3 and admit.params.max_tokens == 7
    assert admit.token_ids == PROMPT + [99, 100, 101, 102]
    assert [t for e in sim.events for t in e.token_ids] == [99, 100, 101, 102]


def test_aborts_in_each_phase_free_the_request_on_the_nodes_that_hold_it():
    sim = cluster()
    waiting = sim.submit()
    sim.prefill_to_first_token(waiting)
    (admit,) = sim.sent(Admit, "d0")
    sim.take(sim.core.abort(waiting.request_id, sim.now))
    # Admitted but SendKV not sent: the decode node may drop its reservation at once.
    assert [(m.request_id, m.kv_unsent) for m in sim.sent(Abort, "d0")] == [
        (admit.request_id, True)
    ]
    assert [m.kv_unsent for m in sim.sent(Abort, "p0")] == [False]
    assert sim.events[-1].finish_reason == "abort" and not sim.core.requests
    # A late Admitted for it: nobody will send KV into that reservation.
    sim.report("d0", Admitted(admit.request_id, True, [1]))
    assert [(m.request_id, m.kv_unsent) for m in sim.sent(Abort, "d0")] == [
        (admit.request_id, True)
    ]


def test_a_node_declared_dead_that_is_alive_is_reset():
    sim = cluster()
    sim.take(sim.core.declare_dead("d0", sim.now))
    sim.heartbeat("d0")
    assert sim.sent(Reset, "d0") == [Reset()]
    assert not sim.core.ready()


def test_refusals_change_nothing():
    sim = cluster(max_pending_requests=1)
    sim.submit()
    sim.orders.clear()
    with pytest.raises(SubmitError) as refused:
        sim.submit()
    assert refused.value.code == "overloaded"
    with pytest.raises(SubmitError, match="context"):
        sim.submit(prompt=list(range(1024)))
    assert len(sim.core.requests) == 1 and sim.orders == [] and len(sim.core.admission) == 0


def test_while_no_decode_node_is_alive_requests_wait_for_one_node_wait_s():
    """Every decode node restarting: a request in flight and one that arrives wait at the
    coordinator, and go on (from the tokens already streamed) when a decode node registers."""
    sim = cluster(conditional_disagg_threshold=20)
    state = sim.submit(prompt=[5, 6, 7])  # generated on d0
    (first,) = sim.sent(Generate, "d0")
    sim.report("d0", Tokens("d0", [TokenItem(first.request_id, 40)]))
    sim.tick(3.5, alive=("p0",))  # d0 goes silent: nothing decodes any more
    assert state.phase is Phase.WAITING_NODE and state.attempt == 1
    assert sim.core.max_model_len == 1024  # the HTTP API still knows the context
    late = sim.submit(prompt=[8, 9])  # taken, not refused
    assert late.phase is Phase.WAITING_NODE and not sim.sent(Generate)
    sim.tick(2.0, alive=("p0",))
    sim.register("d0", NodeRole.DECODE)  # its supervisor started it again
    resumed = {m.request_id: m for m in sim.sent(Generate, "d0")}
    assert set(resumed) == {state.wire_id, late.wire_id}
    assert resumed[state.wire_id].token_ids == [5, 6, 7, 40]  # from the token streamed
    assert resumed[state.wire_id].output_offset == 1
    assert [e.error for e in sim.events] == [None]  # the one token; nothing failed


def test_a_request_that_waited_node_wait_s_for_a_decode_node_fails_with_503():
    sim = cluster(node_wait_s=2.0, conditional_disagg_threshold=20)
    state = sim.submit(prompt=[5, 6, 7])  # generated on d0
    sim.tick(3.5, alive=("p0",))  # d0 dies
    assert state.phase is Phase.WAITING_NODE
    sim.tick(2.5, alive=("p0",))
    (event,) = [e for e in sim.events if e.error]
    assert event.error_code == "unavailable" and "within 2s" in event.error
    assert not sim.core.requests


def test_with_node_wait_s_0_or_before_any_decode_node_a_request_is_refused_at_once():
    sim = cluster(node_wait_s=0)
    sim.tick(3.5, alive=("p0",))
    with pytest.raises(SubmitError, match="no decode node"):
        sim.submit()
    fresh = Sim()  # no decode node has registered yet: nothing to wait for
    fresh.register("p0", NodeRole.PREFILL)
    with pytest.raises(SubmitError, match="no decode node"):
        fresh.submit()
