"""The loop every node role runs around its engine: carry out the coordinator's orders, step the
engine, report what the step made, refresh the load report. A role (prefill, decode, colocated)
says only what is its own: which orders it takes, what it does before a step, what it reports
after one, and how it registers; the loop is the same for all, and the tuner's simulator drives
it through the same two halves (`before_step`, `after_step`) on its own clock.

Torch-free: the engine is reached through the methods every node engine has (`NodeEngine`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.cluster.faults import process_faults
from pdserve.cluster.kv_event_stream import KVEventStream
from pdserve.cluster.node_link import NodeLink
from pdserve.cluster.node_messages import (
    Heartbeat,
    KVEventsAck,
    Message,
    Register,
    Reset,
    Shutdown,
)

logger = logging.getLogger(__name__)

# How long a node with nothing to step waits for an order (ms); a role waiting for KV asks less.
IDLE_WAIT_MS = 5


class NodeEngine(Protocol):
    """What the loop asks of a node's engine."""

    seqs: dict[str, Any]

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[Any]: ...

    def abort(self, request_id: str) -> None: ...

    def check_alive(self) -> None: ...

    def watch_failure(self, on_failure: Callable[[str], None]) -> None: ...


class NodeLoop:
    """One node's loop. Subclasses are the roles: they override the hooks below."""

    def __init__(self, engine: NodeEngine, link: NodeLink) -> None:
        self.engine = engine
        self.link = link
        self.running = True
        self.faults = process_faults(f"node {link.node_id}")  # None unless PDSERVE_FAULTS
        # Blocks entering and leaving its KV tiers, for the coordinator's prefix index (None:
        # an engine that logs none).
        enable = getattr(engine, "enable_kv_events", None)
        self.kv_events = KVEventStream(enable()) if callable(enable) else None

    # -- the role's part ---------------------------------------------------------------------
    def handle(self, msg: Message) -> bool:
        """Carry out an order of the role's; False when the role takes no such order."""
        return False

    def registration(self) -> Register:
        raise NotImplementedError

    def heartbeat(self) -> Heartbeat:
        raise NotImplementedError

    def idle_wait_ms(self) -> int:
        """How long to wait for orders when the engine has nothing to step."""
        return IDLE_WAIT_MS

    def take_in(self) -> None:
        """Before a step, after the orders: what arrived from elsewhere (a decode node's KV)."""

    def report(self, outputs: list[Any]) -> None:
        """After a step: what it made (tokens), and what ended beside it (handoffs)."""

    def reset(self) -> None:
        """The coordinator moved this node's requests elsewhere: drop the role's own state (the
        engine's requests are aborted by the loop)."""

    def start(self) -> None:
        """Once registered, before the first step (threads of the role's own)."""

    def release(self) -> None:
        """After the last step: close the role's endpoints (the loop closes the link)."""

    # -- the loop ----------------------------------------------------------------------------
    def carry_out(self, msg: Message) -> None:
        if isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, KVEventsAck):
            if self.kv_events is not None:
                self.kv_events.acknowledged(msg)
        elif isinstance(msg, Reset):
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
            self.reset()
            self.register()
        elif not self.handle(msg):
            logger.warning("%s ignores %s", type(self).__name__, msg.TYPE)

    def register(self) -> None:
        registration = self.registration()
        if self.kv_events is not None:  # a new stream, opening with what the tiers hold
            registration.kv_stream = self.kv_events.restart()
        self.link.register(registration)

    def step(self) -> None:
        wait = 0 if self.engine.has_unfinished() else self.idle_wait_ms()
        self.before_step(self.link.receive(wait))
        if not self.engine.has_unfinished():
            self.after_step([])
            return
        if self.faults is not None:
            self.faults.step()
        self.after_step(self.engine.step())

    def before_step(self, orders: list[Message]) -> None:
        """Carry out the orders received since the last step; take in what arrived."""
        for msg in orders:
            self.link.carry_out(msg, self.carry_out)
        self.take_in()

    def after_step(self, outputs: list[Any]) -> None:
        """Report the step; refresh the load report when it is due."""
        self.report(outputs)
        if self.link.load_due():
            self.engine.check_alive()  # a dead rank takes the node down, idle or not
            self.link.set_load(self.load_report())

    def load_report(self) -> Heartbeat:
        """The role's heartbeat, with the KV events the coordinator has not acknowledged."""
        beat = self.heartbeat()
        if self.kv_events is not None:
            beat.kv_stream, beat.kv_events = self.kv_events.report()
        return beat

    def run(self) -> None:
        self.engine.watch_failure(self.abandon)
        self.register()
        self.start()
        try:
            while self.running:
                self.step()
        except BaseException:
            # The coordinator sees this node's connections close now, not when the process is
            # gone: the interpreter's teardown (torch's) can take seconds.
            self.link.close()
            raise
        self.close()

    def abandon(self, why: str) -> None:
        """The engine can run no steps any more, as found off the loop's thread (a rank of its
        group died): end the process at once. Its connections close with it, so the coordinator
        moves its requests within disconnect_grace_s; an orderly exit would leave it looking
        alive for seconds (until the loop's next collective fails, and torch's teardown)."""
        logger.critical("node %s ends now: %s", self.link.node_id, why)
        sys.stderr.flush()
        os._exit(1)

    def close(self) -> None:
        self.release()
        self.link.close()
