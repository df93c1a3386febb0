"""The coordinator's state and decisions, apart from its sockets: the registry of nodes, routing,
admission of prefilled sequences into decode nodes, failure handling and every request's progress.

Each handler takes one input (a node's message, a client's submit or abort, a tick of the clock)
with the time it happened, and returns the `Outbox` of what to send: orders to nodes and events to
clients. Nothing here reads a socket or a clock, so the same code runs in the coordinator process
and under a test's or a simulator's clock.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cluster.client_messages import Event
from pdserve.cluster.node_messages import (
    Abort,
    Admit,
    Admitted,
    FinishReason,
    FirstToken,
    Generate,
    HandoffReady,
    Heartbeat,
    Message,
    NodeRole,
    Prefill,
    Register,
    RequestError,
    Reset,
    SendKV,
    Shutdown,
    StartDecode,
    TokenLogprobs,
    Tokens,
    TransferDone,
)
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.admission import AdmissionQueue, Candidate
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.nodes import NodeRegistry, NodeState
from pdserve.coordinator.prefix_index import PrefixIndex
from pdserve.coordinator.request_state import PENDING_PHASES, EarlyAdmission, Phase, RequestState
from pdserve.coordinator.routing import (
    choose_decode_by_prefix,
    choose_early_decode_node,
    choose_local_prefill_node,
    choose_prefill_node,
    early_blocks,
)

logger = logging.getLogger(__name__)

# A node's stall longer than this (the coordinator's loop did not run) is not held against nodes.
STALL_S = 0.5


class SubmitError(Exception):
    """A request refused before it reaches any node. code: overloaded | unavailable | invalid
    | shutdown."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Outbox:
    """What one handler decided to send."""

    orders: list[tuple[bytes, Message]] = field(default_factory=list)  # (node socket, order)
    events: list[Event] = field(default_factory=list)  # to the clients, by request id
    # Node sockets (main) whose connection to check: each found with none is `on_unreachable`.
    connection_checks: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.orders or self.events or self.connection_checks)


# An observer of requests (metrics, stats, traces), called with one of these events and the
# request: submitted (taken and routed), routed (sent to a node: its first attempt or a retry),
# phase (its phase changed or began again), retry (an attempt failed: `error` says why),
# first_token, tokens, finished.
Listener = Callable[[str, RequestState], None]


class CoordinatorCore:
    def __init__(self, config: CoordinatorConfig | None = None) -> None:
        self.config = config or CoordinatorConfig()
        self.nodes = NodeRegistry()
        self.admission = AdmissionQueue()
        # Which blocks each node holds in which KV tier, from the nodes' own KV events.
        self.prefix_index = PrefixIndex()
        self.requests: dict[str, RequestState] = {}  # by request id
        self.by_wire: dict[str, RequestState] = {}  # by the id of its current attempt
        # Prefill nodes' handoff sockets (node id -> ZMQ identity): SendKV goes there.
        self.handoff_identities: dict[str, bytes] = {}
        self.listeners: list[Listener] = []  # observers (metrics): (event name, state)
        self.draining = False
        self.now = 0.0  # the time of the input being handled
        self._out = Outbox()
        self._last_max_model_len = 0  # of the nodes alive when one last registered

    # --- what the deployment looks like ---------------------------------------------------------

    def ready(self) -> bool:
        """At least one node of each kind the deployment needs is alive (and not draining)."""
        if self.draining:
            return False
        decoders = self.nodes.decode_nodes()
        if not decoders:
            return False
        if any(n.role is NodeRole.DECODE for n in decoders):
            return bool(self.nodes.prefill_nodes()) or self.config.conditional_disagg_threshold > 0
        return True

    @property
    def max_model_len(self) -> int:
        """The context every node alive can serve; while none is (all restarting), what the
        last ones could, when requests may wait for them (node_wait_s)."""
        lens = [n.max_model_len for n in self.nodes.alive()]
        if lens:
            return min(lens)
        return self._last_max_model_len if self.config.node_wait_s > 0 else 0

    @property
    def num_pending(self) -> int:
        return sum(1 for s in self.requests.values() if s.phase in PENDING_PHASES)

    def drain(self) -> None:
        """Stop admitting: new requests are refused as unavailable; running ones go on."""
        self.draining = True
        logger.info("draining: %d requests still running", len(self.requests))

    # --- inputs ---------------------------------------------------------------------------------

    def submit(
        self,
        token_ids: list[int],
        params: SamplingParams,
        now: float,
        request_id: str | None = None,
    ) -> tuple[RequestState, Outbox]:
        """Take a request into the cluster; raises SubmitError (nothing changed) if refused."""
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if self.draining:
            raise SubmitError("unavailable", "the server is shutting down; retry elsewhere")
        if request_id in self.requests:
            raise SubmitError("invalid", f"request id {request_id!r} is already in use")
        if not self.nodes.decode_nodes() and not self._may_wait_for_node():
            raise SubmitError("unavailable", "no decode node is available")
        if not token_ids:
            raise SubmitError("invalid", "the prompt is empty")
        limit = self.max_model_len
        if len(token_ids) >= limit:
            raise SubmitError(
                "invalid",
                f"prompt has {len(token_ids)} tokens; the model's context is {limit} tokens, "
                "leaving no room to generate",
            )
        if self.num_pending >= self.config.max_pending_requests:
            raise SubmitError("overloaded", "the server is overloaded; retry later")
        self._begin(now)
        state = RequestState(request_id, list(token_ids), params, arrival=now)
        self.requests[request_id] = state
        self.by_wire[state.wire_id] = state
        self._dispatch(state)
        self._notify("submitted", state)  # routed: observers see where it went
        return state, self._end()

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Outbox:
        """End a request now and free it on every node. reason: "abort" (the client left) or
        "stop" (the frontend matched a stop string: the request is complete)."""
        self._begin(now)
        state = self.requests.get(request_id)
        if state is not None and not state.done:
            logger.info("[%s] ended by the frontend (%s)", request_id, reason)
            self._release_everywhere(state)
            self._finish(state, reason)
        return self._end()

    def on_node_message(self, identity: bytes, msg: Message, now: float) -> Outbox:
        """A message from one of a node's sockets (identity: that socket's ZMQ routing id)."""
        self._begin(now)
        try:
            self._on_node_message(identity, msg)
        except Exception:  # one bad message must not stop the coordinator
            logger.exception("error handling %s from %r", msg.TYPE, identity)
        return self._end()

    def on_undeliverable(self, identity: bytes, msg: Message, now: float) -> Outbox:
        """An order that could not be sent (the socket is gone): a SendKV for a prefill node's
        handoff socket goes to its main socket; anything else waits for the heartbeat timeout
        to decide whether the node is dead."""
        self._begin(now)
        if isinstance(msg, SendKV):
            for node_id, handoff in list(self.handoff_identities.items()):
                if handoff == identity:
                    del self.handoff_identities[node_id]
                    node = self.nodes.nodes.get(node_id)
                    if node is not None and node.alive:
                        self._send(node, msg)
        return self._end()

    def on_tick(self, now: float, stalled_s: float = 0.0) -> Outbox:
        """The clock moved on: expire silent nodes, check the connections that closed
        disconnect_grace_s ago, end overdue handoffs and requests past request_timeout_s, admit
        what fits.
        stalled_s: how long the coordinator itself did not run before this tick; that silence
        is not the nodes', so it is forgiven rather than expiring them."""
        self._begin(now)
        if stalled_s > STALL_S:
            self.nodes.forgive(stalled_s)
            return self._end()
        config = self.config
        for node in self.nodes.expire(config.heartbeat_timeout_s, now):
            self._on_node_dead(node, f"silent for {config.heartbeat_timeout_s:g}s")
        for node in self.nodes.connection_checks(now, config.disconnect_grace_s):
            self._out.connection_checks.append(node.identity)
        # The nodes time their own part of a handoff with transfer_timeout_s and report its
        # end; this catches a report that never comes (lost, or a node that hangs).
        deadline = self.config.transfer_timeout_s + self.config.heartbeat_timeout_s
        for state in list(self.by_wire.values()):
            if (
                state.phase in (Phase.ADMITTING, Phase.TRANSFERRING)
                and now - state.handoff_started > deadline
            ):
                self._requeue(state, f"KV handoff not finished within {deadline:.0f}s")
        limit = self.config.request_timeout_s
        for state in [s for s in self.requests.values() if now - s.arrival > limit]:
            self._release_everywhere(state)
            self._fail(state, "timeout", f"request not finished within {limit:g}s")
        self._expire_waiting(now)
        self._pump_admission()
        return self._end()

    def on_connection_closed(self, identity: bytes | None, now: float) -> Outbox:
        """A connection to the node socket closed. identity: the routing id of the socket whose
        messages came over it, None when the shell cannot tell (none came). A node's main
        socket is checked disconnect_grace_s later (`Outbox.connection_checks`): a live node's
        socket is connected again by then (ZeroMQ reconnects within 0.1 s), a dead process's
        never is. A connection of unknown owner has every node checked."""
        self._begin(now)
        self.nodes.connection_closed(identity, now)
        return self._end()

    def on_unreachable(self, identity: bytes, now: float) -> Outbox:
        """A node socket that the core asked to check has no connection: its node is dead
        (its process died, or its host is cut off), and its requests move elsewhere now."""
        self._begin(now)
        node = self.nodes.by_identity(identity)
        if node is not None and node.alive:
            node.alive = False
            grace = self.config.disconnect_grace_s
            self._on_node_dead(node, f"its connection closed and was not made again in {grace:g}s")
        return self._end()

    def declare_dead(self, node_id: str, now: float) -> Outbox:
        """Treat a node as dead now (as if silent past the heartbeat timeout): its requests move
        elsewhere, and if it is in fact alive its next heartbeat is answered with a Reset."""
        self._begin(now)
        node = self.nodes.nodes.get(node_id)
        if node is not None and node.alive:
            node.alive = False
            self._on_node_dead(node, "declared dead")
        return self._end()

    def shutdown(self, now: float) -> Outbox:
        """Tell every node to stop and end every request."""
        self._begin(now)
        for node in self.nodes.alive():
            self._send(node, Shutdown())
        for state in list(self.requests.values()):
            self._fail(state, "unavailable", "the coordinator is shutting down")
        return self._end()

    # --- routing ------------------------------------------------------------------------------

    def _dispatch(self, state: RequestState) -> None:
        """Send a request (or its retry) to a prefill node, or to a decode node whole; or hold
        it while no decode node is alive."""
        decoders = self.nodes.decode_nodes()
        if not decoders:
            self._wait_for_node(state)
            return
        token_ids = state.resume_token_ids()
        params = state.remaining_params()
        prefillers = self.nodes.prefill_nodes()
        local = choose_local_prefill_node(
            self.config, self.prefix_index, token_ids, decoders, prefillers
        )
        if local is not None or not prefillers:
            node = local
            if node is None:
                self._fail(state, "unavailable", "no decode node is available")
                return
            state.decode_node, state.prefill_node = node.node_id, None
            self._enter(state, Phase.LOCAL_PREFILL)
            node.reserved_blocks += node.blocks_for(len(token_ids))
            node.assigned_prefill_tokens += len(token_ids)
            self._send(
                node, Generate(state.wire_id, token_ids, params, len(state.output_token_ids))
            )
            self._notify("routed", state)
            return
        node = choose_prefill_node(self.config, self.prefix_index, token_ids, prefillers)
        state.prefill_node, state.decode_node = node.node_id, None
        self._enter(state, Phase.PREFILLING)
        node.assigned_prefill_tokens += len(token_ids)
        stream = self._admit_early(state, token_ids)
        self._send(
            node,
            Prefill(state.wire_id, token_ids, params, len(state.output_token_ids), stream),
        )
        self._notify("routed", state)

    def _admit_early(self, state: RequestState, token_ids: list[int]) -> bool:
        """Layer-wise KV streaming: admit a long prompt into a decode node as its prefill
        starts, so the prefill node learns where to send each layer before its last chunk runs.
        The Admit carries the prompt alone; the first token follows in StartDecode. False (the
        request goes today's way) when `routing.choose_early_decode_node` finds none."""
        state.early = EarlyAdmission.NONE
        cfg = self.config
        node = choose_early_decode_node(
            cfg, self.prefix_index, token_ids, self.nodes.kv_receivers(), len(self.admission)
        )
        if node is None:
            return False
        node.reserved_blocks += early_blocks(node, len(token_ids))
        state.decode_node, state.early = node.node_id, EarlyAdmission.ADMITTING
        self._send(
            node,
            Admit(
                state.wire_id,
                token_ids,
                len(token_ids),  # every token's KV comes from the prefill node
                state.remaining_params(),
                transfer_timeout_s=cfg.kv_streaming_timeout_s,
                output_offset=len(state.output_token_ids),
                reuse_prefix=cfg.decode_prefix_reuse,
                first_token_pending=True,
            ),
        )
        return True

    def _choose_decode(self, candidate: Candidate, fitting: list[NodeState]) -> NodeState | None:
        """With decode prefix reuse: `routing.choose_decode_by_prefix` over the sequence's
        computed tokens."""
        state = self.by_wire.get(candidate.request_id)
        if state is None:
            return None
        computed = state.resume_token_ids()[:-1]
        return choose_decode_by_prefix(self.config, self.prefix_index, computed, fitting)

    def _pump_admission(self) -> None:
        receivers = self.nodes.kv_receivers()
        reuse = self.config.decode_prefix_reuse
        choose = self._choose_decode if reuse else None
        for candidate, node in self.admission.admit(
            receivers, self.config.admission_watermark, choose
        ):
            state = self.by_wire.get(candidate.request_id)
            if state is None or state.phase is not Phase.WAITING_ADMISSION:
                node.reserved_blocks -= candidate.num_blocks
                continue
            state.decode_node = node.node_id
            self._enter(state, Phase.ADMITTING)
            state.handoff_started = self.now
            token_ids = state.resume_token_ids()
            self._send(
                node,
                Admit(
                    state.wire_id,
                    token_ids,
                    len(token_ids) - 1,  # the last token's KV is computed by the decode node
                    state.remaining_params(counted_outputs=1),
                    # The decode node counts the last token as its own first output.
                    output_offset=len(state.output_token_ids) - 1,
                    transfer_timeout_s=self.config.transfer_timeout_s,
                    reuse_prefix=reuse,
                ),
            )

    # --- node messages -------------------------------------------------------------------------

    def _on_node_message(self, identity: bytes, msg: Message) -> None:
        node_id = identity.decode(errors="replace")
        if isinstance(msg, Register):
            old = self.nodes.nodes.get(msg.node_id)
            if old is not None and old.alive:
                # A restarted node under the same id: its previous incarnation's requests
                # are gone with it.
                old.alive = False
                self._on_node_dead(old, "registered again")
            node = self.nodes.register(msg, identity, self.now)
            self.prefix_index.register(node.node_id, msg.kv_stream)
            if self.nodes.decode_nodes():
                self._last_max_model_len = min(n.max_model_len for n in self.nodes.alive())
            logger.info(
                "node %s registered (%s, %d KV blocks, transport %s)",
                node.node_id,
                node.role,
                node.num_blocks,
                node.transport,
            )
            if node.decodes:
                self._resume_waiting()
            self._pump_admission()
            return
        if isinstance(msg, HandoffReady):  # may come before or after its node's Register
            self.handoff_identities[msg.node_id] = identity
            return
        if isinstance(msg, Heartbeat):  # from the node's heartbeat socket
            known = self.nodes.nodes.get(msg.node_id)
            # A snapshot sent again (the node is in a long step): its KV events were applied.
            resent = known is not None and known.alive and msg.seq == known.load_seq
            node = self.nodes.heartbeat(msg, self.now)
            if node is None:
                # Declared dead (or never registered) but alive: make it start afresh.
                logger.warning("node %s is not registered: resetting it", msg.node_id)
                self._out.orders.append((msg.node_id.encode(), Reset()))
            elif not resent:
                ack = self.prefix_index.apply(node.node_id, msg.kv_stream, msg.kv_events)
                if ack is not None:
                    self._send(node, ack)
            self._pump_admission()
            return
        node = self.nodes.nodes.get(node_id)
        if node is None or not node.alive:
            logger.warning("message %s from unknown or dead node %s dropped", msg.TYPE, node_id)
            return
        self.nodes.touch(node_id, self.now)
        if isinstance(msg, FirstToken):
            self._on_first_token(node, msg)
        elif isinstance(msg, Admitted):
            self._on_admitted(node, msg)
        elif isinstance(msg, TransferDone):
            self._on_transfer_done(node, msg)
        elif isinstance(msg, Tokens):
            self._on_tokens(node, msg)
        elif isinstance(msg, RequestError):
            self._on_request_error(node, msg)

    def _on_first_token(self, node: NodeState, msg: FirstToken) -> None:
        state = self.by_wire.get(msg.request_id)
        if (
            state is None
            or state.prefill_node != node.node_id
            or state.phase is not Phase.PREFILLING
        ):
            if msg.finish_reason is None:
                self._send(node, Abort(msg.request_id))  # a stale attempt's KV: free it
            return
        state.num_cached_tokens = msg.num_cached_tokens
        # Its prompt has left the node's queue (the next report will agree).
        node.assigned_prefill_tokens = max(
            0, node.assigned_prefill_tokens - len(state.resume_token_ids())
        )
        early, decode_node, wire_id = state.early, state.decode_node, state.wire_id
        self._emit_tokens(state, [msg.token_id], msg.finish_reason, msg.logprobs)
        if state.done:
            if early is not EarlyAdmission.NONE:  # the early reservation is not needed
                target = self.nodes.nodes.get(decode_node or "")
                if target is not None and target.alive:
                    unsent = early is EarlyAdmission.ADMITTING
                    self._send(target, Abort(wire_id, kv_unsent=unsent))
            return
        state.num_blocks = msg.num_blocks
        if early is not EarlyAdmission.NONE:
            state.handoff_started = self.now
            if early is EarlyAdmission.ADMITTING:
                self._enter(state, Phase.ADMITTING)  # _on_admitted goes on
                return
            self._enter(state, Phase.TRANSFERRING)
            self._send(self.nodes.nodes[decode_node], StartDecode(wire_id, msg.token_id))
            return
        self._enter(state, Phase.WAITING_ADMISSION)
        self.admission.push(Candidate(state.wire_id, msg.num_blocks))
        self._pump_admission()

    def _on_admitted(self, node: NodeState, msg: Admitted) -> None:
        state = self.by_wire.get(msg.request_id)
        if (
            state is not None
            and state.decode_node == node.node_id
            and state.early is EarlyAdmission.ADMITTING
        ):
            self._on_early_admitted(node, state, msg)
            return
        if state is None or state.decode_node != node.node_id or state.phase is not Phase.ADMITTING:
            if msg.ok:  # a reservation nobody will send KV into
                self._send(node, Abort(msg.request_id, kv_unsent=True))
            return
        if not msg.ok:
            # The node had less room than it reported: retry first in line after its next report.
            node.reserved_blocks = node.free_blocks
            state.decode_node = None
            self._enter(state, Phase.WAITING_ADMISSION)
            self.admission.push(Candidate(state.wire_id, state.num_blocks), front=True)
            return
        prefill = self.nodes.nodes.get(state.prefill_node or "")
        if prefill is None or not prefill.alive:
            self._requeue(state, "prefill node lost before its KV was sent")
            return
        self._enter(state, Phase.TRANSFERRING)
        send_kv = SendKV(
            state.wire_id,
            node.node_id,
            node.receiver_info,
            msg.dst_blocks,
            self.config.transfer_timeout_s,
            msg.num_reused,
        )
        # The handoff socket's thread starts the send at once; the main socket's loop only
        # between steps.
        self._send(prefill, send_kv, self.handoff_identities.get(prefill.node_id))

    def _on_early_admitted(self, node: NodeState, state: RequestState, msg: Admitted) -> None:
        if not msg.ok:
            # The node had less room than it reported: the request goes today's way.
            node.reserved_blocks = node.free_blocks
            state.early, state.decode_node = EarlyAdmission.NONE, None
            if state.phase is Phase.ADMITTING:  # its first token came already
                self._enter(state, Phase.WAITING_ADMISSION)
                self.admission.push(Candidate(state.wire_id, state.num_blocks), front=True)
                self._pump_admission()
            return
        prefill = self.nodes.nodes.get(state.prefill_node or "")
        if prefill is None or not prefill.alive:
            self._requeue(state, "prefill node lost before its KV was sent")
            return
        state.early = EarlyAdmission.ADMITTED
        send_kv = SendKV(
            state.wire_id,
            node.node_id,
            node.receiver_info,
            msg.dst_blocks,
            self.config.transfer_timeout_s,
            msg.num_reused,
            prefilling=state.phase is Phase.PREFILLING,
        )
        self._send(prefill, send_kv, self.handoff_identities.get(prefill.node_id))
        if state.phase is Phase.ADMITTING:  # the first token came before the reservation
            self._enter(state, Phase.TRANSFERRING)
            self._send(node, StartDecode(state.wire_id, state.output_token_ids[-1]))

    def _on_transfer_done(self, node: NodeState, msg: TransferDone) -> None:
        state = self.by_wire.get(msg.request_id)
        if state is None or state.done:
            return
        if msg.ok:
            if state.phase is Phase.TRANSFERRING:
                self._enter(state, Phase.DECODING)
            return
        streaming = state.phase is Phase.PREFILLING and state.early is not EarlyAdmission.NONE
        if state.phase in (Phase.TRANSFERRING, Phase.ADMITTING) or streaming:
            self._requeue(state, f"KV transfer failed on {node.node_id}: {msg.error}")

    def _on_tokens(self, node: NodeState, msg: Tokens) -> None:
        for item in msg.items:
            state = self.by_wire.get(item.request_id)
            if state is None or state.decode_node != node.node_id or state.done:
                continue  # a stale attempt on a node the request has left
            if state.phase is not Phase.DECODING:
                self._enter(state, Phase.DECODING)
            self._emit_tokens(state, [item.token_id], item.finish_reason, item.logprobs)

    def _on_request_error(self, node: NodeState, msg: RequestError) -> None:
        state = self.by_wire.get(msg.request_id)
        if state is None or state.done:
            return
        if msg.retryable:
            self._requeue(state, f"{node.node_id}: {msg.message}")
        else:
            self._release_everywhere(state)
            self._fail(state, "invalid", msg.message)

    # --- failure handling ------------------------------------------------------------------------

    def _on_node_dead(self, node: NodeState, why: str) -> None:
        logger.warning("node %s (%s) marked dead: %s", node.node_id, node.role, why)
        self.prefix_index.forget(node.node_id)
        for state in list(self.by_wire.values()):
            on_prefill = state.prefill_node == node.node_id and state.phase in (
                Phase.PREFILLING,
                Phase.WAITING_ADMISSION,
                Phase.ADMITTING,
                Phase.TRANSFERRING,
            )
            on_decode = state.decode_node == node.node_id and state.phase in (
                Phase.LOCAL_PREFILL,
                Phase.ADMITTING,
                Phase.TRANSFERRING,
                Phase.DECODING,
                Phase.PREFILLING,  # admitted early (layer-wise KV streaming)
            )
            if on_prefill or on_decode:
                self._requeue(state, f"node {node.node_id} died")

    def _requeue(self, state: RequestState, reason: str) -> None:
        """Start the request over elsewhere from prompt + the tokens already streamed."""
        self._release_everywhere(state)
        if state.attempt >= self.config.max_retries:
            self._fail(
                state, "unavailable", f"request failed after {state.attempt} retries: {reason}"
            )
            return
        logger.warning("[%s] retrying (%s)", state.request_id, reason)
        del self.by_wire[state.wire_id]
        state.attempt += 1
        state.error = reason
        self.by_wire[state.wire_id] = state
        self._notify("retry", state)
        self._dispatch(state)

    # --- no decode node alive -------------------------------------------------------------------

    def _may_wait_for_node(self) -> bool:
        """Whether a request may wait for a decode node to come back: node_wait_s is on and
        decode nodes have served here before (they are restarting, not yet to start)."""
        return self.config.node_wait_s > 0 and self._last_max_model_len > 0

    def _wait_for_node(self, state: RequestState) -> None:
        if not self._may_wait_for_node():
            self._fail(state, "unavailable", "no decode node is left")
            return
        logger.warning("[%s] waiting for a decode node (none is alive)", state.request_id)
        state.waiting_since = self.now
        state.prefill_node = state.decode_node = None
        self._enter(state, Phase.WAITING_NODE)

    def _resume_waiting(self) -> None:
        """A decode node is back: the requests that waited for one go on."""
        for state in [s for s in self.by_wire.values() if s.phase is Phase.WAITING_NODE]:
            self._dispatch(state)

    def _expire_waiting(self, now: float) -> None:
        wait = self.config.node_wait_s
        for state in [s for s in self.by_wire.values() if s.phase is Phase.WAITING_NODE]:
            if now - state.waiting_since > wait:
                self._fail(state, "unavailable", f"no decode node came back within {wait:g}s")

    def _release_everywhere(self, state: RequestState) -> None:
        """Tell every live node that holds part of this attempt to free it."""
        self.admission.remove(state.wire_id)
        # Admitted but SendKV not yet sent (it goes out when the decode node confirms): no KV
        # will come, and the decode node may free its reservation at once.
        kv_unsent = state.early is EarlyAdmission.ADMITTING or (
            state.early is EarlyAdmission.NONE and state.phase is Phase.ADMITTING
        )
        for node_id in {state.prefill_node, state.decode_node} - {None}:
            node = self.nodes.nodes.get(node_id)
            if node is not None and node.alive:
                unsent = kv_unsent and node_id == state.decode_node
                self._send(node, Abort(state.wire_id, kv_unsent=unsent))

    # --- events ----------------------------------------------------------------------------------

    def _emit_tokens(
        self,
        state: RequestState,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        logprobs: TokenLogprobs | None,
    ) -> None:
        if state.first_token_at is None:
            state.first_token_at = self.now
            self._notify("first_token", state)
        state.output_token_ids += token_ids
        event = Event(
            state.request_id,
            token_ids=token_ids,
            logprobs=[logprobs] if logprobs is not None else [],
            num_prompt_tokens=len(state.prompt_token_ids),
            num_cached_tokens=state.num_cached_tokens,
        )
        if finish_reason is not None:
            event.finish_reason = finish_reason.value
            self._close(state, finish_reason.value)
        self._out.events.append(event)
        self._notify("tokens", state)

    def _finish(self, state: RequestState, reason: str) -> None:
        self._close(state, reason)
        self._out.events.append(
            Event(
                state.request_id,
                finish_reason=reason,
                num_prompt_tokens=len(state.prompt_token_ids),
            )
        )

    def _fail(self, state: RequestState, code: str, message: str) -> None:
        logger.warning("[%s] failed: %s", state.request_id, message)
        state.error = message
        self._close(state, "error")
        self._out.events.append(Event(state.request_id, error=message, error_code=code))

    def _close(self, state: RequestState, reason: str) -> None:
        state.finish_reason = reason
        state.finished_at = self.now
        self._enter(state, Phase.DONE)
        self.by_wire.pop(state.wire_id, None)
        self.requests.pop(state.request_id, None)
        self._notify("finished", state)

    def _enter(self, state: RequestState, phase: Phase) -> None:
        """Every change of a request's phase (or a new attempt at one) goes through here."""
        state.phase = phase
        self._notify("phase", state)

    def _notify(self, name: str, state: RequestState) -> None:
        for listener in self.listeners:
            try:
                listener(name, state)
            except Exception:  # an observer must never cost a request its events
                logger.exception("[%s] listener failed on %s", state.request_id, name)

    def _send(self, node: NodeState, msg: Message, identity: bytes | None = None) -> None:
        """To the node's main socket, or to another of its sockets by identity."""
        self._out.orders.append((identity or node.identity, msg))

    def _begin(self, now: float) -> None:
        self.now = now
        self._out = Outbox()

    def _end(self) -> Outbox:
        out, self._out = self._out, Outbox()
        return out
