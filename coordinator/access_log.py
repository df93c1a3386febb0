"""Each HTTP request's id in the log: an ASGI wrapper gives every request one (the `x-request-id`
header) and writes its access line, and a log filter prefixes it to every line written for it."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("pdserve.access")


@dataclass(slots=True)
class RequestContext:
    request_id: str


_current: ContextVar[RequestContext | None] = ContextVar("pdserve_request", default=None)


def name_request(prefix: str) -> str:
    """A fresh completion id, which every log line of this HTTP request carries from here on."""
    request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
    ctx = _current.get()
    if ctx is not None:
        ctx.request_id = request_id
    return request_id


def current_request_id() -> str | None:
    """The id of the HTTP request being served here, if any."""
    ctx = _current.get()
    return ctx.request_id if ctx is not None else None


class RequestIdLogFilter(logging.Filter):
    """Prefixes `[request id]` to any log line written while serving an HTTP request."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        if ctx is not None and ctx.request_id not in record.getMessage():
            record.msg = f"[{ctx.request_id}] {record.msg}"
        return True


class AccessLog:
    """ASGI wrapper: gives every HTTP request an id (the `x-request-id` response header) and logs
    one access line when its response has ended, streamed or not."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = RequestContext(f"http-{uuid.uuid4().hex[:16]}")
        token = _current.set(ctx)
        start = time.monotonic()
        status = 0
        body_bytes = 0

        async def send_logged(message: dict) -> None:
            nonlocal status, body_bytes
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", ctx.request_id.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                body_bytes += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        except Exception:  # already answered 500 by the app's handler; keep the server up
            logger.exception("unhandled error")
            status = status or 500
        finally:
            client = scope.get("client") or ("-", 0)
            access_logger.info(
                '%s:%s "%s %s" %d %dB %.3fs',
                client[0],
                client[1],
                scope["method"],
                scope["path"],
                status,
                body_bytes,
                time.monotonic() - start,
            )
            _current.reset(token)
