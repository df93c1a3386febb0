"""A real OTLP trace collector for tests: an HTTP server (POST /v1/traces, protobuf) or a gRPC
server (TraceService.Export) on a thread of the test process, which decodes every export with
opentelemetry-proto and keeps each span with its resource's attributes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    attributes: dict[str, Any]
    resource: dict[str, Any]
    error: bool
    events: tuple[str, ...] = ()

    @property
    def service(self) -> str:
        return self.resource.get("service.name", "")


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict[str, Any]:  # noqa: ANN001
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Collector:
    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            _attributes(s.attributes),
                            resource,
                            s.status.code == Status.STATUS_CODE_ERROR,
                            tuple(e.name for e in s.events),
                        )
                    )
        with self._lock:
            self.spans += received
            self.exports += 1

    def wait_for(
        self, what: str, found: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """Polls until `found(spans)` holds; fails naming `what` after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"waited {timeout_s:.0f} s for {what}; received {names}")
            time.sleep(0.05)


@contextmanager
def http_collector() -> Iterator[tuple[Collector, str]]:
    """A collector listening for OTLP/HTTP, and its traces URL."""
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            collector.take(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield collector, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def grpc_collector() -> Iterator[tuple[Collector, str]]:
    """A collector listening for OTLP/gRPC, and its endpoint (http://: no TLS)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    collector = Collector()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: ANN001, ANN201, N802
            collector.take(request.SerializeToString())
            return ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)
