"""A request's trace at the coordinator: a listener of the core that opens a `request` span per
request (a child of the HTTP request's span, current when it is submitted), a span per phase
under it, and a `routing` span per attempt; and that stamps each order starting work on a node
with the traceparent of the span current for its request, so the node's spans hang from it.

Made only while tracing is on (`pdserve.cluster.tracing`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pdserve.cluster import tracing
from pdserve.cluster.node_messages import Admit, Generate, Message, Prefill, SendKV
from pdserve.coordinator.request_state import Phase, RequestState

# Each phase's span, named for what the request waits on in it.
PHASE_SPANS = {
    Phase.WAITING_NODE: "queue",  # at the coordinator, for a decode node to come back
    Phase.PREFILLING: "prefill",  # on a prefill node
    Phase.LOCAL_PREFILL: "prefill",  # on the decode (or colocated) node that decodes it
    Phase.WAITING_ADMISSION: "queue",  # at the coordinator, for a decode node with room
    Phase.ADMITTING: "admission",  # a decode node reserving blocks
    Phase.TRANSFERRING: "kv_transfer",  # its KV on the way
    Phase.DECODING: "decode",
}
# The orders that start work on a node, which carry a trace context.
TRACED_ORDERS = (Prefill, Generate, Admit, SendKV)


@dataclass(slots=True)
class RequestTrace:
    request: Any  # the request's span
    span: Any = None  # the current phase's span
    phase_started_ns: int = 0


class RequestTracer:
    """A core listener (`CoordinatorCore.listeners`); `stamp` is called on every outbox."""

    def __init__(self) -> None:
        self.traces: dict[str, RequestTrace] = {}  # by request id

    def __call__(self, event: str, state: RequestState) -> None:
        trace = self.traces.get(state.request_id)
        if trace is None:
            if state.done:
                return
            # Started inside the submit of an HTTP request: its span is the current one.
            span = tracing.start_span(
                "request",
                attributes={
                    "pdserve.request_id": state.request_id,
                    "pdserve.prompt_tokens": len(state.prompt_token_ids),
                    "pdserve.max_tokens": state.params.max_tokens,
                },
            )
            trace = self.traces[state.request_id] = RequestTrace(span)
        if event == "phase":
            self._enter(trace, state)
        elif event == "routed":
            routing = tracing.start_span(
                "routing",
                trace.request,
                {
                    "pdserve.attempt": state.attempt,
                    "pdserve.route": "local" if state.prefill_node is None else "disaggregated",
                    "pdserve.prefill_node": state.prefill_node or "",
                    "pdserve.decode_node": state.decode_node or "",
                },
                start_ns=trace.phase_started_ns or None,
            )
            tracing.end_span(routing)
        elif event == "retry":
            tracing.end_span(trace.span, state.error)
            trace.span = None
            trace.request.add_event(
                "retry", {"pdserve.attempt": state.attempt, "pdserve.reason": state.error or ""}
            )
        elif event == "first_token":
            trace.request.add_event("first_token")
        elif event == "finished":
            self._finish(trace, state)

    def _enter(self, trace: RequestTrace, state: RequestState) -> None:
        tracing.end_span(trace.span)
        trace.span = None
        trace.phase_started_ns = time.time_ns()
        name = PHASE_SPANS.get(state.phase)
        if name is None:  # done
            return
        attributes: dict[str, object] = {"pdserve.attempt": state.attempt}
        node = state.prefill_node if state.phase is Phase.PREFILLING else state.decode_node
        if node is not None and state.phase is not Phase.WAITING_ADMISSION:
            attributes["pdserve.node"] = node
        trace.span = tracing.start_span(
            name, trace.request, attributes, start_ns=trace.phase_started_ns
        )

    def _finish(self, trace: RequestTrace, state: RequestState) -> None:
        del self.traces[state.request_id]
        reason = state.finish_reason or "error"
        error = (state.error or reason) if reason == "error" else None
        tracing.end_span(trace.span, error)
        tracing.end_span(
            trace.request,
            error,
            {
                "pdserve.finish_reason": reason,
                "pdserve.completion_tokens": len(state.output_token_ids),
                "pdserve.cached_tokens": state.num_cached_tokens,
                "pdserve.attempts": state.attempt + 1,
            },
        )

    def stamp(self, orders: list[tuple[bytes, Message]]) -> None:
        """Give each order that starts work on a node the traceparent of its request's current
        span (the phase it was sent in)."""
        for _, msg in orders:
            if isinstance(msg, TRACED_ORDERS) and not msg.trace_context:
                trace = self.traces.get(msg.request_id.rpartition("#")[0])
                if trace is not None:
                    msg.trace_context = tracing.traceparent(trace.span or trace.request)
