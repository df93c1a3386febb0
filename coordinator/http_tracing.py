"""Each HTTP request's span, while tracing is on: an ASGI wrapper opens a server span (a child of
the client's `traceparent` header, when it sends a valid one), makes it current while the app
serves the request, so the requests it submits hang from it, and answers with the trace's id in
the `x-pdserve-trace-id` header."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.cluster import tracing
from pdserve.coordinator.access_log import current_request_id

# Probes and scrapes are not traced: they would bury the requests' traces.
UNTRACED_PATHS = ("/health", "/metrics", "/version")


class TraceRequests:
    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not tracing.enabled() or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method, path = scope["method"], scope["path"]
        span = tracing.start_span(
            f"{method} {path}",
            headers,
            {"http.request.method": method, "url.path": path, "http.route": path},
            server=True,
        )
        trace_id = tracing.trace_id(span).encode()
        status = 0

        async def send_traced(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [
                    *message.get("headers", []),
                    (tracing.TRACE_ID_HEADER.encode(), trace_id),
                ]
                message = {**message, "headers": headers}
            await send(message)

        token = tracing.activate(span)
        try:
            await self.app(scope, receive, send_traced)
        except BaseException:
            status = status or 500
            raise
        finally:
            tracing.deactivate(token)
            attributes = {"http.response.status_code": status}
            request_id = current_request_id()
            if request_id:
                attributes["pdserve.request_id"] = request_id
            tracing.end_span(span, f"HTTP {status}" if status >= 500 else None, attributes)
