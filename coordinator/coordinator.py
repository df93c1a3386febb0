"""The coordinator process's sockets around its core (`coordinator/core.py`): a ZMQ ROUTER that
nodes connect to, an optional ROUTER for Python clients (`CoordinatorClient`), a clock, and the
per-request event streams its in-process users (the HTTP API) read.

Everything runs in one asyncio loop (zmq.asyncio), the HTTP API's loop too. Every receive loop
drops malformed frames of any shape, logging the first from each peer; a task that dies anyway
is logged with its traceback and sets `failed`, on which the process exits non-zero so that its
supervisor restarts it, rather than serving errors forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path

import zmq
import zmq.asyncio

from pdserve.cluster import node_messages, tracing
from pdserve.cluster.client_messages import Cancel, Event, Submit, client_events, client_requests
from pdserve.cluster.codec import MAX_FRAME_BYTES, Codec, MalformedLog, ProtocolError, peer_name
from pdserve.cluster.faults import message_faults
from pdserve.cluster.keys import (
    ClusterKeys,
    close_server,
    curve_server,
    log_refused_handshakes,
    watch_server_socket,
)
from pdserve.cluster.link_session import LinkSession
from pdserve.cluster.node_messages import Message
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.core import CoordinatorCore, Outbox, SubmitError
from pdserve.coordinator.nodes import NodeRegistry
from pdserve.coordinator.request_state import PENDING_PHASES, RequestState
from pdserve.coordinator.request_tracing import RequestTracer
from pdserve.coordinator.stats import INTERVAL_S, StatsCounter

logger = logging.getLogger(__name__)
stats_logger = logging.getLogger("pdserve.stats")

__all__ = ["Coordinator", "RequestHandle", "SubmitError"]

TICK_S = 0.1
SHUTDOWN_MESSAGE = "the server is shutting down"
MAX_SESSIONS = 4096  # node sockets whose link sessions are kept (the least recent go)


class RequestHandle:
    """Async iterator over a request's events; ends after the event that finishes it."""

    def __init__(self, state: RequestState, events: asyncio.Queue[Event]) -> None:
        self.state = state
        self.request_id = state.request_id
        self._events = events

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if event.finish_reason is not None or event.error is not None:
                return


def router_socket(
    ctx: zmq.asyncio.Context, address: str, keys: ClusterKeys | None, label: str
) -> zmq.asyncio.Socket:
    """A ROUTER bound at address; with keys, it admits only holders of the cluster keys."""
    sock = ctx.socket(zmq.ROUTER)
    if keys is not None:
        curve_server(sock, keys, label)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable peer raises instead of dropping
    # libzmq drops a peer that sends a message larger than this before we ever see it.
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_FRAME_BYTES)
    sock.bind(address)
    return sock


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig | None = None,
        node_addr: str = "tcp://127.0.0.1:0",
        client_addr: str | None = None,
        config_path: str | Path | None = None,
        keys: ClusterKeys | None = None,
    ) -> None:
        """keys: the cluster key set its sockets admit (None: any peer, unencrypted)."""
        self.core = CoordinatorCore(config)
        self.keys = keys
        self.config_path = config_path
        self._node_bind = node_addr
        self._client_bind = client_addr
        self._streams: dict[str, asyncio.Queue[Event]] = {}  # by request id
        self.shutting_down = False  # set by cut_requests: nothing new is admitted
        self._tasks: list[asyncio.Task] = []
        self.node_endpoint = ""
        self.client_endpoint = ""
        self.failed: asyncio.Event | None = None  # set when one of its tasks died
        self.failure: BaseException | None = None
        self._malformed_nodes = MalformedLog(logger, "coordinator node socket")
        self._malformed_clients = MalformedLog(logger, "coordinator client socket")
        # The link session of each node socket that speaks one (by routing id); a socket that
        # sends bare frames (a node's load reports) gets bare frames.
        self._sessions: OrderedDict[bytes, LinkSession] = OrderedDict()
        # Whose each node-socket connection is, by its file descriptor: the routing id of the
        # socket whose messages last came over it (their ZMQ_SRCFD), so that its close is named.
        self._connection_owners: dict[int, bytes] = {}
        self._node_faults = message_faults("coordinator node socket")
        self.stats = StatsCounter(time.monotonic())
        self.core.listeners.append(self.stats.observe)
        # Requests' spans, while tracing is on (`pdserve.cluster.tracing.setup` came first).
        self.tracer = RequestTracer() if tracing.enabled() else None
        if self.tracer is not None:
            self.core.listeners.append(self.tracer)

    # --- what the HTTP API, metrics and tests read ------------------------------------------------

    @property
    def config(self) -> CoordinatorConfig:
        return self.core.config

    @property
    def nodes(self) -> NodeRegistry:
        return self.core.nodes

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.core.requests

    @property
    def listeners(self) -> list:
        return self.core.listeners

    @property
    def handoff_identities(self) -> dict[str, bytes]:
        return self.core.handoff_identities

    @property
    def draining(self) -> bool:
        return self.core.draining

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def num_pending(self) -> int:
        return self.core.num_pending

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens of the requests not yet decoding (what waits for a node's time)."""
        return sum(
            len(r.prompt_token_ids) for r in self.requests.values() if r.phase in PENDING_PHASES
        )

    def check_room(self, requests: int, tokens: int) -> None:
        """SubmitError unless `requests` more, of `tokens` prompt tokens in all, fit under
        max_pending_requests and max_pending_tokens (a request larger than the token bound
        alone is invalid: it would never fit)."""
        config = self.config
        if tokens > config.max_pending_tokens:
            raise SubmitError(
                "invalid",
                f"{tokens} prompt tokens exceed max_pending_tokens ({config.max_pending_tokens})",
            )
        if self.num_pending + requests > config.max_pending_requests:
            logger.info("refused: %d requests already pending", self.num_pending)
            raise SubmitError("overloaded", "the server is overloaded; retry later")
        if self.pending_tokens + tokens > config.max_pending_tokens:
            logger.info("refused: %d prompt tokens already pending", self.pending_tokens)
            raise SubmitError("overloaded", "the server is overloaded; retry later")

    def ready(self) -> bool:
        return self.core.ready()

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.failed = asyncio.Event()
        self.ctx = zmq.asyncio.Context.instance()
        self.node_sock = router_socket(
            self.ctx, self._node_bind, self.keys, "coordinator node socket"
        )
        self.node_endpoint = self.node_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._spawn(self._node_loop(), "coordinator-nodes")
        self._spawn(self._clock_loop(), "coordinator-clock")
        # A node process that dies closes its connections at once, and they are never made
        # again: it is found in disconnect_grace_s, not heartbeat_timeout_s.
        self._spawn(
            watch_server_socket(
                self.node_sock,
                "coordinator node socket",
                keyed=self.keys is not None,
                on_disconnect=self._on_connection_closed,
            ),
            "coordinator-node-connections",
        )
        if self._client_bind:
            self.client_sock = router_socket(
                self.ctx, self._client_bind, self.keys, "coordinator client socket"
            )
            self.client_endpoint = self.client_sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._spawn(self._client_loop(), "coordinator-clients")
            if self.keys is not None:
                self._spawn(
                    log_refused_handshakes(self.client_sock, "coordinator client socket"),
                    "coordinator-client-handshakes",
                )
        logger.info("coordinator listening for nodes on %s", self.node_endpoint)

    def _spawn(self, coro: Coroutine, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_ended)
        self._tasks.append(task)

    def _task_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            exc = RuntimeError(f"{task.get_name()} returned")
        logger.critical("%s died; the coordinator cannot go on", task.get_name(), exc_info=exc)
        if self.failure is None:
            self.failure = exc
        if self.failed is not None:
            self.failed.set()

    async def stop(self, shutdown_nodes: bool = True) -> None:
        out = self.core.shutdown(time.monotonic())
        if not shutdown_nodes:
            out.orders.clear()
        self._deliver(out)
        if out.orders:
            await asyncio.sleep(0.05)  # let the Shutdown orders leave before the socket closes
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        close_server(self.node_sock)
        if self._client_bind:
            close_server(self.client_sock)

    async def wait_for_nodes(self, prefill: int, decode: int, timeout_s: float = 120.0) -> None:
        """Until that many prefill and decode nodes have registered; TimeoutError saying how
        many did after timeout_s."""

        async def count() -> None:
            while (
                len(self.nodes.prefill_nodes()) < prefill or len(self.nodes.decode_nodes()) < decode
            ):
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(count(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"nodes did not register within {timeout_s:g}s: "
                f"{len(self.nodes.prefill_nodes())} of {prefill} prefill, "
                f"{len(self.nodes.decode_nodes())} of {decode} decode"
            ) from None

    def drain(self) -> None:
        self.core.drain()

    def declare_dead(self, node_id: str) -> None:
        """Move a node's requests elsewhere now; if it is alive, it is reset and rejoins."""
        self._deliver(self.core.declare_dead(node_id, time.monotonic()))

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

    async def submit(
        self, token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Admit a request into the cluster; raises SubmitError if it is refused."""
        if self.shutting_down:
            raise SubmitError("shutdown", SHUTDOWN_MESSAGE)
        self.check_room(1, len(token_ids))
        try:  # what cannot go on the wire is refused here, before the request holds anything
            node_messages.orders.encode(node_messages.Generate("-", token_ids, params, 0))
        except (OverflowError, TypeError, ValueError) as exc:
            raise SubmitError("invalid", f"the request cannot be sent to a node: {exc}") from None
        state, out = self.core.submit(token_ids, params, time.monotonic(), request_id)
        events: asyncio.Queue[Event] = asyncio.Queue()
        self._streams[state.request_id] = events
        self._deliver(out)
        return RequestHandle(state, events)

    async def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now and free it on every node. reason: "abort" (the client left) or
        "stop" (the frontend matched a stop string: the request is complete)."""
        if request_id not in self.requests:
            return False
        self._deliver(self.core.abort(request_id, time.monotonic(), reason))
        return True

    def cut_requests(self) -> int:
        """Shutdown: end every open request now with a "shutdown" error event (its reader answers
        at once) and free it on every node; later submissions are refused. Returns how many."""
        self.shutting_down = True
        cut = list(self._streams.items())
        self._streams.clear()  # the abort's own finish event goes nowhere: the error ended it
        for request_id, events in cut:
            state = self.requests.get(request_id)
            streamed = len(state.output_token_ids) if state is not None else 0
            logger.info("[%s] cut by shutdown after %d tokens streamed", request_id, streamed)
            events.put_nowait(Event(request_id, error=SHUTDOWN_MESSAGE, error_code="shutdown"))
            self._deliver(self.core.abort(request_id, time.monotonic()))
        return len(cut)

    # --- delivery --------------------------------------------------------------------------------

    def _deliver(self, out: Outbox) -> None:
        if self.tracer is not None:
            self.tracer.stamp(out.orders)
        for identity, msg in out.orders:
            if not self._send_order(identity, msg):
                self._deliver(self.core.on_undeliverable(identity, msg, time.monotonic()))
        for identity in out.connection_checks:
            if not self._connected(identity):
                self._deliver(self.core.on_unreachable(identity, time.monotonic()))
        for event in out.events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            stream.put_nowait(event)
            if event.finish_reason is not None or event.error is not None:
                del self._streams[event.request_id]

    def _send_order(self, identity: bytes, msg: Message) -> bool:
        """False when the order cannot be sent: no socket of that identity is connected."""
        frame = node_messages.orders.encode(msg)
        session = self._sessions.get(identity)
        frames = (
            [identity, *session.wrap(frame, time.monotonic())] if session else [identity, frame]
        )
        # zmq.asyncio reports a failed send through the future it returns, not by raising.
        sent = self.node_sock.send_multipart(frames, zmq.NOBLOCK)
        if not sent.done():  # queued behind a busy pipe: its outcome comes later
            sent.add_done_callback(lambda f: self._log_send_failure(f, identity, msg))
            return True
        return not self._log_send_failure(sent, identity, msg)

    def _connected(self, identity: bytes) -> bool:
        """Whether a node socket has a connection now: the router takes a message for it (an
        acknowledgement of its link session, which a node always takes) or refuses it as
        unroutable (ROUTER_MANDATORY). True when it cannot tell: a socket with no session."""
        session = self._sessions.get(identity)
        if session is None:
            return True
        sent = self.node_sock.send_multipart([identity, *session.acknowledgement()], zmq.NOBLOCK)
        if not sent.done():  # queued behind a busy pipe: connected
            sent.add_done_callback(_ignore_failure)
            return True
        exc = None if sent.cancelled() else sent.exception()
        return not (isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH)

    def _on_connection_closed(self, fd: int) -> None:
        identity = self._connection_owners.pop(fd, None)
        if identity is not None:
            logger.debug("the connection of node socket %r closed", identity)
        self._deliver(self.core.on_connection_closed(identity, time.monotonic()))

    @staticmethod
    def _log_send_failure(sent: asyncio.Future, identity: bytes, msg: Message) -> bool:
        if sent.cancelled() or sent.exception() is None:
            return False
        # A node that stopped before its Shutdown (on its own signal, or serve stopped it) is fine,
        # and so is one gone before the acknowledgement of its KV events (it needs it no more).
        quiet = isinstance(msg, node_messages.Shutdown | node_messages.KVEventsAck)
        level = logging.DEBUG if quiet else logging.WARNING
        logger.log(level, "could not send %s to %r: %s", msg.TYPE, identity, sent.exception())
        return True

    # --- loops -----------------------------------------------------------------------------------

    async def _node_loop(self) -> None:
        while True:
            received = await self.node_sock.recv_multipart(copy=False)
            if len(received) > 1:
                with contextlib.suppress(zmq.ZMQError):  # (a transport with no descriptor)
                    self._connection_owners[received[1].get(zmq.SRCFD)] = received[0].bytes
            frames = [frame.bytes for frame in received]
            if self._node_faults is None:
                self._on_node_frames(frames[0], frames[1:])
                continue
            for identity, *rest in self._node_faults.arrive(frames, skip=1):
                self._on_node_frames(identity, rest)

    def received_from(self, identity: bytes) -> tuple[int, int]:
        """The link session of the node behind identity, and how many of its messages were
        handed on (0, 0 if none): a load snapshot that counts as many sent (`Heartbeat.link_sent`
        in that session) was taken after the node sent the last of them. Call on the loop."""
        session = self._sessions.get(identity)
        if session is None:
            return 0, 0
        return session.peer_session, session.expected - 1

    def _on_node_frames(self, identity: bytes, frames: list[bytes]) -> None:
        """One message received from a node socket: bare (one frame), or in a link session."""
        now = time.monotonic()
        if len(frames) != 2:
            messages = [
                self._decode(identity, frames, node_messages.reports, self._malformed_nodes)
            ]
        else:
            session = self._sessions.pop(identity, None) or LinkSession()
            try:
                bodies = session.unwrap(frames, now)
            except ProtocolError as exc:
                self._malformed_nodes(peer_name(identity), str(exc))
                bodies = []
            if session.peer_session:  # (never for junk)
                self._sessions[identity] = session
                if len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            messages = [
                self._decode(identity, [b], node_messages.reports, self._malformed_nodes)
                for b in bodies
            ]
        for msg in messages:
            if msg is not None:
                self._deliver(self.core.on_node_message(identity, msg, now))

    def _flush_sessions(self, now: float) -> None:
        """Send what the node sockets' sessions owe (resends, acknowledgements), and take in
        the messages an injected delay held back."""
        if self._node_faults is not None:
            for identity, *rest in self._node_faults.due(now):
                self._on_node_frames(identity, rest)
        for identity, session in list(self._sessions.items()):
            for frames in session.due(now):
                sent = self.node_sock.send_multipart([identity, *frames], zmq.NOBLOCK)
                sent.add_done_callback(_ignore_failure)  # a resend to a node that is gone

    async def _clock_loop(self) -> None:
        last = time.monotonic()
        next_stats = last + INTERVAL_S
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            stalled = now - last - TICK_S
            last = now
            self._deliver(self.core.on_tick(now, stalled))
            self._flush_sessions(now)
            if now >= next_stats:
                next_stats = now + INTERVAL_S
                stats = self.stats.sample(self.core, now)
                if stats is not None:
                    stats_logger.info("%s", stats.line())

    async def _client_loop(self) -> None:
        forwarders: set[asyncio.Task] = set()
        while True:
            identity, *frames = await self.client_sock.recv_multipart()
            msg = self._decode(identity, frames, client_requests, self._malformed_clients)
            if isinstance(msg, Submit):
                task = asyncio.create_task(self._serve_client(identity, msg))
                forwarders.add(task)
                task.add_done_callback(forwarders.discard)
            elif isinstance(msg, Cancel):
                await self.abort(msg.request_id)

    @staticmethod
    def _decode(
        identity: bytes, frames: list[bytes], codec: Codec, malformed: MalformedLog
    ) -> Message | None:
        """The one message a peer's frames carry, or None (dropped, logged once per peer)."""
        try:
            return codec.decode_frames(frames)
        except ProtocolError as exc:
            malformed(peer_name(identity), str(exc))
            return None

    async def _serve_client(self, identity: bytes, msg: Submit) -> None:
        async def reply(event: Event) -> None:
            await self.client_sock.send_multipart([identity, client_events.encode(event)])

        try:
            handle = await self.submit(msg.token_ids, msg.params, msg.request_id)
        except SubmitError as exc:
            await reply(Event(msg.request_id, error=str(exc), error_code=exc.code))
            return
        try:
            async for event in handle:
                await reply(event)
        except zmq.ZMQError:  # the client is gone, or the socket closed under us
            await self.abort(handle.request_id)


def _ignore_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled():
        sent.exception()  # retrieved, so asyncio does not log it
