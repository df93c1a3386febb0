"""What every HTTP request passes before a route sees it: the API key (`Authorization: Bearer
KEY`, or Anthropic's `x-api-key: KEY`, compared in constant time; 401 without one) on the model's routes, and the size of its body
(413 beyond `max_request_body_bytes`, before the body is read where its length is declared)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Sequence

from fastapi.responses import JSONResponse

from pdserve.coordinator.anthropic_protocol import error_body, is_messages_path
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.openai_protocol import APIError

API_KEY_ENV = "PDSERVE_API_KEY"  # one key, or several separated by commas
# The routes that use the model; /health, /version and the schema stay open.
KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def api_keys_from(
    flags: Sequence[str] | None, environ: dict[str, str] | None = None
) -> tuple[str, ...]:
    """The API keys: the --api-key flags given, else $PDSERVE_API_KEY; none means open."""
    environ = os.environ if environ is None else environ
    keys = list(flags or ())
    if not keys and environ.get(API_KEY_ENV):
        keys = [k.strip() for k in environ[API_KEY_ENV].split(",")]
    if any(not k for k in keys):
        raise ValueError(f"an API key is empty (in --api-key or ${API_KEY_ENV})")
    return tuple(keys)


class RequestGuard:
    """ASGI middleware in front of the API's routes."""

    def __init__(
        self, app: Callable, api_keys: Sequence[str], config: Callable[[], CoordinatorConfig]
    ) -> None:
        """config: the coordinator's current config (its limits change on a live reload)."""
        self.app = app
        self._keys = [k.encode() for k in api_keys]
        self._config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        config = self._config()
        refusal = self._authorize(scope, config) or self._declared_size(scope, config)
        if refusal is not None:
            body = error_body(refusal) if is_messages_path(scope["path"]) else refusal.body()
            response = JSONResponse(body, refusal.status, refusal.headers())
            await response(scope, receive, send)
            return
        await self.app(scope, self._bounded(receive, config.max_request_body_bytes), send)

    def _authorize(self, scope: Scope, config: CoordinatorConfig) -> APIError | None:
        path = scope["path"]
        keyed = path.startswith(KEYED_PREFIXES) or (
            path == "/metrics" and config.metrics_require_api_key
        )
        if not self._keys or not keyed:
            return None
        given = _given_key(scope)
        if given is None:
            return Unauthorized(
                "You didn't provide an API key. Give it in an Authorization header using Bearer "
                "auth (Authorization: Bearer YOUR_KEY), or in an x-api-key header."
            )
        matched = False
        for key in self._keys:  # every key compared, in constant time each
            matched |= hmac.compare_digest(given, key)
        return None if matched else Unauthorized("Incorrect API key provided.")

    @staticmethod
    def _declared_size(scope: Scope, config: CoordinatorConfig) -> APIError | None:
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_body_bytes:
            return TooLarge(config.max_request_body_bytes)
        return None

    @staticmethod
    def _bounded(receive: Receive, limit: int) -> Receive:
        """receive(), refusing (413, from inside the route) a body that grows past the limit
        without having declared its length."""
        received = 0

        async def bounded() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise TooLarge(limit)
            return message

        return bounded


def _given_key(scope: Scope) -> bytes | None:
    """The key a request gives: its bearer token, else its x-api-key header (Anthropic's)."""
    header = _header(scope, b"authorization")
    scheme, _, given = (header or b"").partition(b" ")
    if header is not None and scheme.lower() == b"bearer":
        return given.strip()
    return _header(scope, b"x-api-key")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class Unauthorized(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(401, message, code="invalid_api_key")

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class TooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body exceeds {limit} bytes", code="request_too_large")
