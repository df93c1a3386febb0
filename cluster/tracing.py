"""OpenTelemetry traces of requests across the coordinator and its nodes: `setup` from the
`--otlp-traces-endpoint` flag, spans that hang from a W3C `traceparent` string carried in the
wire orders, and `RequestSpans`, a process's open spans by request.

Off unless an endpoint is given: only `setup` imports opentelemetry, and while it is off every
helper returns at its first line (`_tracer is None`) and starts nothing. The exporter is OTLP,
over gRPC or HTTP (protobuf): the protocol the OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or
OTEL_EXPORTER_OTLP_PROTOCOL) variable names, else HTTP for an endpoint whose path ends in
`/v1/traces` and gRPC for any other (vLLM's default). The SDK's own variables hold as usual:
OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES over the process's default service name,
OTEL_BSP_* for the batch processor, OTEL_EXPORTER_OTLP_* for the exporter.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

# The HTTP response header that names a request's trace (32 hex digits) while tracing is on.
TRACE_ID_HEADER = "x-pdserve-trace-id"
PROTOCOLS = ("grpc", "http/protobuf")
OTEL_EXTRA = "pip install 'pdserve[otel]'"

_tracer: Any = None  # the opentelemetry Tracer while tracing is on; None: off
_provider: Any = None
_propagator: Any = None


def enabled() -> bool:
    return _tracer is not None


def protocol_for(endpoint: str, environ: Mapping[str, str] = os.environ) -> str:
    """How spans go to `endpoint`: grpc or http/protobuf (see the module's docstring)."""
    named = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    if named:
        named = named.strip().lower()
        if named not in PROTOCOLS:
            raise ValueError(
                f"OTLP protocol {named!r} is not supported for traces (use {' or '.join(PROTOCOLS)})"
            )
        return named
    return "http/protobuf" if urlsplit(endpoint).path.rstrip("/").endswith("/v1/traces") else "grpc"


def http_traces_url(endpoint: str) -> str:
    """An HTTP collector's traces URL: the endpoint as given, or with /v1/traces added when it
    names no path (http://host:4318)."""
    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def setup(endpoint: str | None, service: str, **resource: str) -> bool:
    """Export this process's spans to `endpoint` over OTLP, as `service` (unless OTEL_SERVICE_NAME
    or OTEL_RESOURCE_ATTRIBUTES names one), with `resource` attributes beside it (dots for
    underscores: node_id= gives pdserve.node_id). No endpoint: tracing stays off, nothing is
    imported. False when off."""
    global _tracer, _provider, _propagator
    if not endpoint:
        return False
    protocol = protocol_for(endpoint)
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = http_traces_url(endpoint)
    except ImportError as exc:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({exc.name} is missing): {OTEL_EXTRA}"
        ) from None
    from pdserve import __version__

    if _provider is not None:
        shutdown()
    attributes = {f"pdserve.{k}": v for k, v in resource.items()}
    detected = Resource.create({})  # what the environment says
    if str(detected.attributes.get("service.name", "")).startswith("unknown_service"):
        attributes["service.name"] = service
    attributes.setdefault("service.version", __version__)
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    # A provider of pdserve's own, not the global one: libraries that trace whenever a global
    # provider is set (FastAPI's own spans) stay as they were.
    _provider, _tracer = provider, provider.get_tracer("pdserve", __version__)
    _propagator = TraceContextTextMapPropagator()
    name = provider.resource.attributes.get("service.name")
    logger.info("tracing: spans of %s go to %s over OTLP (%s)", name, endpoint, protocol)
    return True


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans ended so far now (a test's or a stopping process's)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Export what is left and turn tracing off."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()


# --- spans ----------------------------------------------------------------------------------------


def start_span(
    name: str,
    parent: str | Mapping[str, str] | Any = None,
    attributes: Mapping[str, Any] | None = None,
    start_ns: int | None = None,
    server: bool = False,
) -> Any:
    """A started span, or None while tracing is off. parent: a `traceparent` string, HTTP
    headers holding one (a string or headers without a valid one: a new trace), another span,
    or None (the current context's span, if any). server: the span of a request from outside."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    if parent is None:
        context = None
    elif isinstance(parent, str):
        context = _propagator.extract({"traceparent": parent})
    elif isinstance(parent, Mapping):
        context = _propagator.extract(parent)
    else:
        context = trace.set_span_in_context(parent)
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    return _tracer.start_span(
        name, context=context, kind=kind, attributes=attributes, start_time=start_ns
    )


def end_span(
    span: Any, error: str | None = None, attributes: Mapping[str, Any] | None = None
) -> None:
    """End a span (None: nothing), with more attributes and, if error, an error status."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def traceparent(span: Any) -> str:
    """The W3C `traceparent` of a span ("" for None): what a child elsewhere hangs from."""
    if span is None or _propagator is None:
        return ""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def trace_id(span: Any) -> str:
    """The span's trace id, 32 hex digits ("" for None)."""
    return "" if span is None else format(span.get_span_context().trace_id, "032x")


def activate(span: Any) -> object | None:
    """Make span the current one (spans started without a parent hang from it) until
    `deactivate(token)`, in the same task or thread."""
    if span is None:
        return None
    from opentelemetry import context, trace

    return context.attach(trace.set_span_in_context(span))


def deactivate(token: object | None) -> None:
    if token is not None:
        from opentelemetry import context

        context.detach(token)


class RequestSpans:
    """A process's open spans, by request id and span name; any thread may call it. Every
    method returns at once while tracing is off, and `start` without a parent does nothing: a
    node traces the requests whose orders came with a trace context."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], Any] = {}
        self._counts: dict[tuple[str, str], dict[str, int]] = {}
        self._lock = threading.Lock()

    def start(
        self,
        request_id: str,
        name: str,
        parent: str | None,
        attributes: Mapping[str, Any] | None = None,
        within: str | None = None,
    ) -> None:
        """Open span `name` of a request, child of `parent` (a traceparent), or of the request's
        open span `within`."""
        if _tracer is None:
            return
        with self._lock:
            if within is not None:
                parent = self._open.get((request_id, within))
            if not parent:
                return
            old = self._open.pop((request_id, name), None)
            span = start_span(name, parent, attributes)
            self._open[(request_id, name)] = span
        if old is not None:
            end_span(old, "superseded")

    def is_open(self, request_id: str, name: str) -> bool:
        return (request_id, name) in self._open

    def count(self, request_id: str, name: str, attribute: str, n: int = 1) -> None:
        """Add n to a counting attribute of an open span (set when it ends)."""
        if _tracer is None or (request_id, name) not in self._open:
            return
        with self._lock:
            counts = self._counts.setdefault((request_id, name), {})
            counts[attribute] = counts.get(attribute, 0) + n

    def end(
        self,
        request_id: str,
        name: str,
        error: str | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        if _tracer is None:
            return
        with self._lock:
            span = self._open.pop((request_id, name), None)
            counts = self._counts.pop((request_id, name), None)
        if span is not None:
            end_span(span, error, {**(counts or {}), **(attributes or {})})

    def end_all(self, request_id: str, error: str | None = None) -> None:
        """End every open span of a request (it was aborted, or failed)."""
        if _tracer is None:
            return
        with self._lock:
            names = [name for rid, name in self._open if rid == request_id]
        for name in names:
            self.end(request_id, name, error)

    def end_every(self, error: str) -> None:
        """End every open span (the node dropped all its requests)."""
        if _tracer is None:
            return
        with self._lock:
            keys = list(self._open)
        for request_id, name in keys:
            self.end(request_id, name, error)
