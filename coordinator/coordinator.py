"""The coordinator: a ZMQ ROUTER that nodes connect to, the registry of their load, routing,
admission of prefilled sequences into decode nodes, failure handling, and the per-request event
streams its clients read (in process through `submit`, or remotely through `CoordinatorClient`).

Everything runs in one asyncio loop (zmq.asyncio), the HTTP API's loop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from cluster import node_messages
from cluster.client_messages import Cancel, Event, Submit, client_events, client_requests
from cluster.codec import ProtocolError
from cluster.node_messages import (
    Abort,
    Admit,
    Admitted,
    FirstToken,
    Generate,
    HandoffReady,
    Heartbeat,
    NodeRole,
    Prefill,
    Register,
    RequestError,
    Reset,
    SendKV,
    Shutdown,
    Tokens,
    TransferDone,
)  # fmt: skip
from cluster.sampling_params import SamplingParams
from coordinator.admission import AdmissionQueue, Candidate
from coordinator.config import CoordinatorConfig
from coordinator.nodes import NodeRegistry, NodeState
from coordinator.request_state import PENDING_PHASES, Phase, RequestState
from coordinator.routing import PrefixAffinity, least_loaded, most_free_blocks

logger = logging.getLogger(__name__)


class SubmitError(Exception):
    """A request refused before it reaches any node. code: overloaded | unavailable | invalid."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RequestHandle:
    """Async iterator over a request's events; ends after the event that finishes it."""

    def __init__(self, state: RequestState) -> None:
        self.state = state
        self.request_id = state.request_id

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.state.events.get()
            yield event
            if event.finish_reason is not None or event.error is not None:
                return


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig | None = None,
        node_addr: str = "tcp://127.0.0.1:0",
        client_addr: str | None = None,
        model_name: str = "pdserve-tiny",
        config_path: str | Path | None = None,
    ) -> None:
        self.config = config or CoordinatorConfig()
        self.config_path = config_path
        self.model_name = model_name
        self._node_bind = node_addr
        self._client_bind = client_addr
        self.nodes = NodeRegistry()
        self.admission = AdmissionQueue()
        self.affinity = PrefixAffinity()
        self.requests: dict[str, RequestState] = {}  # by request id
        self.by_wire: dict[str, RequestState] = {}  # by the id of its current attempt
        # Prefill nodes' handoff sockets (node id -> ZMQ identity): SendKV goes there.
        self.handoff_identities: dict[str, bytes] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.node_endpoint = ""
        self.client_endpoint = ""
        self.listeners: list = []  # callables(event_name, state) for metrics
        self.draining = False

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.node_sock = self.ctx.socket(zmq.ROUTER)
        self.node_sock.setsockopt(zmq.LINGER, 0)
        self.node_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.node_sock.bind(self._node_bind)
        self.node_endpoint = self.node_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks.append(asyncio.create_task(self._node_loop(), name="coordinator-nodes"))
        self._tasks.append(asyncio.create_task(self._timer_loop(), name="coordinator-timer"))
        if self._client_bind:
            self.client_sock = self.ctx.socket(zmq.ROUTER)
            self.client_sock.setsockopt(zmq.LINGER, 0)
            self.client_sock.bind(self._client_bind)
            self.client_endpoint = self.client_sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(asyncio.create_task(self._client_loop(), name="coordinator-clients"))
        logger.info("coordinator listening for nodes on %s", self.node_endpoint)

    async def stop(self, shutdown_nodes: bool = True) -> None:
        if shutdown_nodes:
            for node in self.nodes.alive():
                self._send(node, Shutdown())
            await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for state in list(self.requests.values()):
            self._fail(state, "unavailable", "the coordinator is shutting down")
        self.node_sock.close(0)
        if self._client_bind:
            self.client_sock.close(0)

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

    async def wait_for_nodes(self, prefill: int, decode: int, timeout_s: float = 120.0) -> None:
        async def count() -> None:
            while (
                len(self.nodes.prefill_nodes()) < prefill or len(self.nodes.decode_nodes()) < decode
            ):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(count(), timeout_s)

    def drain(self) -> None:
        """Stop admitting: new requests are refused as unavailable; running ones go on."""
        self.draining = True
        logger.info("draining: %d requests still running", len(self.requests))

    async def wait_drained(self, timeout_s: float) -> bool:
        """Until every request has finished (True) or timeout_s passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.requests

    def reload_config(self) -> list[str]:
        """SIGHUP: re-read the TOML file and apply the fields that may change live."""
        if self.config_path is None:
            return []
        new = CoordinatorConfig.from_toml(self.config_path)
        changed = self.config.reload_from(new)
        fixed = self.config.fixed_differences(new)
        logger.info("config reloaded: changed %s", changed or "nothing")
        if fixed:
            logger.warning("config fields %s need a restart to take effect", fixed)
        return changed

    # --- the client-facing API -----------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        lens = [n.max_model_len for n in self.nodes.alive()]
        return min(lens) if lens else 0

    @property
    def num_pending(self) -> int:
        return sum(1 for s in self.requests.values() if s.phase in PENDING_PHASES)

    async def submit(
        self, token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Admit a request into the cluster; raises SubmitError if it is refused."""
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if self.draining:
            raise SubmitError("unavailable", "the server is shutting down; retry elsewhere")
        if request_id in self.requests:
            raise SubmitError("invalid", f"request id {request_id!r} is already in use")
        if not self.nodes.decode_nodes():
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
        state = RequestState(request_id, list(token_ids), params)
        self.requests[request_id] = state
        self.by_wire[state.wire_id] = state
        self._dispatch(state)
        self._notify("submitted", state)
        return RequestHandle(state)

    async def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now and free it on every node. reason: "abort" (the client left) or
        "stop" (the frontend matched a stop string: the request is complete)."""
        state = self.requests.get(request_id)
        if state is None or state.done:
            return False
        logger.info("[%s] ended by the frontend (%s)", request_id, reason)
        self._release_everywhere(state)
        self._finish(state, reason)
        return True

    # --- routing ------------------------------------------------------------------------------

    def _dispatch(self, state: RequestState) -> None:
        """Send a request (or its retry) to a prefill node, or to a decode node whole."""
        token_ids = state.resume_token_ids()
        params = state.remaining_params()
        prefillers = self.nodes.prefill_nodes()
        local = not prefillers or self._prefill_locally(token_ids, prefillers)
        if local:
            node = self._choose_local(token_ids)
            if node is None:
                self._fail(state, "unavailable", "no decode node is available")
                return
            state.phase, state.decode_node, state.prefill_node = (
                Phase.LOCAL_PREFILL,
                node.node_id,
                None,
            )
            node.reserved_blocks += -(-len(token_ids) // node.block_size)
            node.assigned_prefill_tokens += len(token_ids)
            self._send(
                node, Generate(state.wire_id, token_ids, params, len(state.output_token_ids))
            )
            return
        if self.config.prefill_routing == "prefix_affinity":
            node = self.affinity.choose(
                token_ids,
                prefillers,
                self.config.prefix_affinity_min_blocks,
                self.config.prefix_affinity_max_load_ratio,
            )
            self.affinity.record(token_ids, node)
        else:
            node = least_loaded(prefillers)
        state.phase, state.prefill_node, state.decode_node = Phase.PREFILLING, node.node_id, None
        node.assigned_prefill_tokens += len(token_ids)
        self._send(node, Prefill(state.wire_id, token_ids, params, len(state.output_token_ids)))

    def _prefill_locally(self, token_ids: list[int], prefillers: list[NodeState]) -> bool:
        """Conditional disaggregation: short prompts, or every prefill queue over its limit."""
        cfg = self.config
        if len(token_ids) < cfg.conditional_disagg_threshold:
            return True
        limit = cfg.prefill_queue_limit_tokens
        return limit > 0 and all(n.prefill_load > limit for n in prefillers)

    def _choose_local(self, token_ids: list[int]) -> NodeState | None:
        nodes = self.nodes.decode_nodes()
        colocated = [n for n in nodes if n.role is NodeRole.COLOCATED]
        return most_free_blocks(colocated or nodes)

    def _pump_admission(self) -> None:
        decoders = [n for n in self.nodes.decode_nodes() if n.role is NodeRole.DECODE]
        for candidate, node in self.admission.admit(decoders, self.config.admission_watermark):
            state = self.by_wire.get(candidate.request_id)
            if state is None or state.phase is not Phase.WAITING_ADMISSION:
                node.reserved_blocks -= candidate.num_blocks
                continue
            state.phase, state.decode_node = Phase.ADMITTING, node.node_id
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
                ),
            )

    # --- node messages -------------------------------------------------------------------------

    async def _node_loop(self) -> None:
        while True:
            identity, *frames = await self.node_sock.recv_multipart()
            try:
                if len(frames) != 1:
                    raise ProtocolError(f"{len(frames)} frames, expected 1")
                msg = node_messages.reports.decode(frames[0])
            except ProtocolError as exc:
                logger.warning("dropped malformed message from %r: %s", identity, exc)
                continue
            try:
                self._on_node_message(identity, msg)
            except Exception:  # one bad message must not stop the coordinator
                logger.exception("error handling %s from %r", msg.TYPE, identity)

    def _on_node_message(self, identity: bytes, msg: node_messages.Message) -> None:
        node_id = identity.decode(errors="replace")
        if isinstance(msg, Register):
            old = self.nodes.nodes.get(msg.node_id)
            if old is not None and old.alive:
                # A restarted node under the same id: its previous incarnation's requests
                # are gone with it.
                old.alive = False
                self._on_node_dead(old)
            node = self.nodes.register(msg, identity)
            logger.info("node %s registered (%s, %d KV blocks, transport %s)",
                        node.node_id, node.role, node.num_blocks, node.transport)  # fmt: skip
            self._pump_admission()
            return
        if isinstance(msg, HandoffReady):  # may come before or after its node's Register
            self.handoff_identities[msg.node_id] = identity
            return
        if isinstance(msg, Heartbeat):  # from the node's heartbeat socket
            if self.nodes.heartbeat(msg) is None:
                # Declared dead (or never registered) but alive: make it start afresh.
                logger.warning("node %s is not registered: resetting it", msg.node_id)
                with contextlib.suppress(zmq.ZMQError):
                    self.node_sock.send_multipart(
                        [msg.node_id.encode(), node_messages.orders.encode(Reset())], zmq.NOBLOCK
                    )
            self._pump_admission()
            return
        node = self.nodes.nodes.get(node_id)
        if node is None or not node.alive:
            logger.warning("message %s from unknown or dead node %s dropped", msg.TYPE, node_id)
            return
        self.nodes.touch(node_id)
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
        else:
            logger.warning("unexpected %s from node %s", msg.TYPE, node_id)

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
        finish_reason = msg.finish_reason.value if msg.finish_reason is not None else None
        self._emit_tokens(
            state, [msg.token_id], finish_reason, [msg.logprobs] if msg.logprobs else []
        )
        if state.done:
            return
        state.phase, state.num_blocks = Phase.WAITING_ADMISSION, msg.num_blocks
        self.admission.push(Candidate(state.wire_id, msg.num_blocks))
        self._pump_admission()

    def _on_admitted(self, node: NodeState, msg: Admitted) -> None:
        state = self.by_wire.get(msg.request_id)
        if state is None or state.decode_node != node.node_id or state.phase is not Phase.ADMITTING:
            if msg.ok:  # a reservation nobody will send KV into
                self._send(node, Abort(msg.request_id, kv_unsent=True))
            return
        if not msg.ok:
            # The node had less room than it reported: retry first in line after its next report.
            node.reserved_blocks = node.free_blocks
            state.phase, state.decode_node = Phase.WAITING_ADMISSION, None
            self.admission.push(Candidate(state.wire_id, state.num_blocks), front=True)
            return
        prefill = self.nodes.nodes.get(state.prefill_node or "")
        if prefill is None or not prefill.alive:
            self._requeue(state, "prefill node lost before its KV was sent")
            return
        state.phase = Phase.TRANSFERRING
        send_kv = SendKV(
            state.wire_id, node.node_id, node.receiver_info, msg.dst_blocks,
            self.config.transfer_timeout_s,
        )  # fmt: skip
        handoff = self.handoff_identities.get(prefill.node_id)
        if handoff is None or not self._send(prefill, send_kv, handoff):
            self._send(prefill, send_kv)  # handled between the prefill node's steps

    def _on_transfer_done(self, node: NodeState, msg: TransferDone) -> None:
        state = self.by_wire.get(msg.request_id)
        if state is None or state.done:
            return
        if msg.ok:
            if state.phase is Phase.TRANSFERRING:
                state.phase = Phase.DECODING
            return
        if state.phase in (Phase.TRANSFERRING, Phase.ADMITTING):
            self._requeue(state, f"KV transfer failed on {node.node_id}: {msg.error}")

    def _on_tokens(self, node: NodeState, msg: Tokens) -> None:
        for item in msg.items:
            state = self.by_wire.get(item.request_id)
            if state is None or state.decode_node != node.node_id or state.done:
                continue  # a stale attempt on a node the request has left
            if state.phase is not Phase.DECODING:
                state.phase = Phase.DECODING
            reason = item.finish_reason.value if item.finish_reason is not None else None
            self._emit_tokens(
                state, [item.token_id], reason, [item.logprobs] if item.logprobs else []
            )

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

    async def _timer_loop(self, tick_s: float = 0.1) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            stalled = now - last - tick_s
            last = now
            if stalled > 0.5:
                self.nodes.forgive(stalled)
                continue
            for node in self.nodes.expire(self.config.heartbeat_timeout_s):
                self._on_node_dead(node)
            self._pump_admission()

    def _on_node_dead(self, node: NodeState) -> None:
        logger.warning("node %s (%s) is silent: marked dead", node.node_id, node.role)
        self.affinity.forget_node(node.node_id)
        for state in list(self.by_wire.values()):
            on_prefill = state.prefill_node == node.node_id and state.phase in (
                Phase.PREFILLING, Phase.WAITING_ADMISSION, Phase.ADMITTING, Phase.TRANSFERRING,
            )  # fmt: skip
            on_decode = state.decode_node == node.node_id and state.phase in (
                Phase.LOCAL_PREFILL, Phase.ADMITTING, Phase.TRANSFERRING, Phase.DECODING,
            )  # fmt: skip
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
        self.by_wire[state.wire_id] = state
        if not self.nodes.decode_nodes():
            self._fail(state, "unavailable", "no decode node is left")
            return
        self._dispatch(state)

    def _release_everywhere(self, state: RequestState) -> None:
        """Tell every live node that holds part of this attempt to free it."""
        self.admission.remove(state.wire_id)
        # Admitted but SendKV not yet sent (it goes out when the decode node confirms): no KV
        # will come, and the decode node may free its reservation at once.
        kv_unsent = state.phase is Phase.ADMITTING
        for node_id in {state.prefill_node, state.decode_node} - {None}:
            node = self.nodes.nodes.get(node_id)
            if node is not None and node.alive:
                unsent = kv_unsent and node_id == state.decode_node
                self._send(node, Abort(state.wire_id, kv_unsent=unsent))

    # --- events ----------------------------------------------------------------------------------

    def _emit_tokens(
        self, state: RequestState, token_ids: list[int], finish_reason: str | None, logprobs: list
    ) -> None:
        if state.first_token_at is None:
            state.first_token_at = time.monotonic()
            self._notify("first_token", state)
        state.output_token_ids += token_ids
        event = Event(
            state.request_id,
            token_ids=token_ids,
            logprobs=logprobs,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_cached_tokens=state.num_cached_tokens,
        )
        if finish_reason is not None:
            event.finish_reason = finish_reason
            self._close(state, finish_reason)
        state.events.put_nowait(event)
        self._notify("tokens", state)

    def _finish(self, state: RequestState, reason: str) -> None:
        self._close(state, reason)
        state.events.put_nowait(
            Event(state.request_id, finish_reason=reason,
                  num_prompt_tokens=len(state.prompt_token_ids))
        )  # fmt: skip

    def _fail(self, state: RequestState, code: str, message: str) -> None:
        logger.warning("[%s] failed: %s", state.request_id, message)
        self._close(state, "error")
        state.events.put_nowait(Event(state.request_id, error=message, error_code=code))

    def _close(self, state: RequestState, reason: str) -> None:
        state.phase = Phase.DONE
        state.finish_reason = reason
        self.by_wire.pop(state.wire_id, None)
        self.requests.pop(state.request_id, None)
        self._notify("finished", state)

    def _notify(self, name: str, state: RequestState) -> None:
        for listener in self.listeners:
            try:
                listener(name, state)
            except Exception:  # an observer must never cost a request its events
                logger.exception("[%s] listener failed on %s", state.request_id, name)

    def _send(
        self, node: NodeState, msg: node_messages.Message, identity: bytes | None = None
    ) -> bool:
        """To the node's main socket, or to another of its sockets by identity."""
        try:
            frames = [identity or node.identity, node_messages.orders.encode(msg)]
            self.node_sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # unroutable (gone) or full: the heartbeat timeout decides
            logger.warning("could not send %s to %s: %s", msg.TYPE, node.node_id, exc)
            return False
        return True

    # --- remote clients --------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        forwarders: set[asyncio.Task] = set()
        while True:
            identity, *frames = await self.client_sock.recv_multipart()
            try:
                if len(frames) != 1:
                    raise ProtocolError(f"{len(frames)} frames, expected 1")
                msg = client_requests.decode(frames[0])
            except ProtocolError as exc:
                logger.warning("dropped malformed message from client %r: %s", identity, exc)
                continue
            if isinstance(msg, Submit):
                task = asyncio.create_task(self._serve_client(identity, msg))
                forwarders.add(task)
                task.add_done_callback(forwarders.discard)
            elif isinstance(msg, Cancel):
                await self.abort(msg.request_id)

    async def _serve_client(self, identity: bytes, msg: Submit) -> None:
        async def reply(event: Event) -> None:
            await self.client_sock.send_multipart([identity, client_events.encode(event)])

        try:
            handle = await self.submit(msg.token_ids, msg.params, msg.request_id)
        except SubmitError as exc:
            await reply(Event(msg.request_id, error=str(exc), error_code=exc.code))
            return
        except (ValueError, TypeError) as exc:
            await reply(Event(msg.request_id, error=str(exc), error_code="invalid"))
            return
        try:
            async for event in handle:
                await reply(event)
        except zmq.ZMQError:  # the socket closed under us: shutting down
            return
