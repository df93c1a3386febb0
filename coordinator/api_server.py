"""The OpenAI-compatible HTTP server (FastAPI on uvicorn, in the coordinator's event loop): its
routes (completions, chat completions, Anthropic's messages, models, vLLM's tokenize and
detokenize, version, health, Prometheus metrics, the OpenAPI schema and its docs page), the OpenAI
error body for every failure (Anthropic's on the Messages API's paths), and running it on a socket
bound before the nodes start."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.cluster import tracing
from pdserve.coordinator.access_log import AccessLog, RequestIdLogFilter
from pdserve.coordinator.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    is_messages_path,
)
from pdserve.coordinator.http_tracing import TraceRequests
from pdserve.coordinator.metrics import CONTENT_TYPE
from pdserve.coordinator.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    coordinator_error,
)
from pdserve.coordinator.request_guard import KEYED_PREFIXES, RequestGuard
from pdserve.coordinator.responses_protocol import ResponsesRequest
from pdserve.coordinator.serving import OpenAIServing
from pdserve.coordinator.serving_chat import OpenAIServingChat
from pdserve.coordinator.serving_completion import OpenAIServingCompletion
from pdserve.coordinator.serving_messages import AnthropicServingMessages
from pdserve.coordinator.serving_responses import OpenAIServingResponses
from pdserve.coordinator.serving_tokenization import OpenAIServingTokenization
from pdserve.engine.embedded.catalog import model_name

logger = logging.getLogger(__name__)


def default_model_names(model: str | None) -> tuple[str, ...]:
    """What clients call the model without --served-model-name: the embedded model's name, or the
    checkpoint directory's name."""
    return (model_name(model),)


# The bodies the routes parse themselves (strictly, with OpenAI's errors), for the schema.
REQUEST_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/v1/responses": (ResponsesRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
    "/v1/messages": (MessagesRequest,),
    "/v1/messages/count_tokens": (CountTokensRequest,),
}


def openapi_schema(app: FastAPI, keyed: bool = False) -> dict:
    """FastAPI's schema of the routes, with the request bodies the routes read by hand (and, with
    API keys, the bearer auth the model's routes take)."""
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, models in REQUEST_BODIES.items():
        refs = []
        for model in models:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
        content = refs[0] if len(refs) == 1 else {"anyOf": refs}
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": content}},
        }
    if keyed:
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path.startswith(KEYED_PREFIXES):
                for operation in operations.values():
                    operation["security"] = [{"apiKey": []}]
    return schema


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    """The error body of the API the path is: Anthropic's for the Messages API, else OpenAI's."""
    body = error_body(exc) if is_messages_path(path) else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers())


def build_app(serving: OpenAIServing, version: str, api_keys: tuple[str, ...] = ()) -> FastAPI:
    """The API's routes; with api_keys, the model's routes need one of them."""
    app = FastAPI(
        title="pdserve",
        version=version,
        description="OpenAI-compatible API of a disaggregated prefill/decode LLM server.",
        redoc_url=None,
    )
    completion = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(serving)
    messages = AnthropicServingMessages(serving, chat)
    tokenization = OpenAIServingTokenization(serving)
    responses = OpenAIServingResponses(serving, chat)
    app.add_middleware(RequestGuard, api_keys=api_keys, config=lambda: serving.coordinator.config)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            logger.warning("%d: %s", exc.status, exc.message)
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind), request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            APIError(500, "internal server error", "server_error", code="internal_error"),
            request.url.path,
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.create_chat_completion(request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create_response(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        return await messages.create_message(request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> dict:
        return await messages.count_tokens(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await tokenization.detokenize(request)

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models()

    @app.get("/version")
    async def version_() -> dict:
        return {"version": version}

    @app.get("/health")
    async def health() -> Response:
        # 200 or 503 is for load balancers; the counts tell `pdserve launch` when every node
        # it started has registered.
        if serving.coordinator.ready():
            nodes = serving.coordinator.nodes.count_by_role()
            return JSONResponse({"status": "ok", "nodes": nodes})
        return error_response(coordinator_error("unavailable", "no node of a needed kind is ready"))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    def schema() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app, keyed=bool(api_keys))
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
    return app


def listen_socket(host: str, port: int) -> socket.socket:
    """Bound before uvicorn starts, so a busy port is a clean error, and port 0 works."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class _Server(uvicorn.Server):
    # The coordinator's process owns the signals (stop, SIGHUP reload); uvicorn must not.
    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201
        yield


async def serve_http(
    app: FastAPI,
    sock: socket.socket,
    stop: asyncio.Event,
    log_level: str | None = None,
    on_stop: Callable[[], object] | None = None,
) -> None:
    """Run uvicorn in this event loop on `sock` until `stop` is set; its own logs at `log_level`
    (uvicorn's names, trace among them; unset: the root logger's). on_stop runs once `stop` is
    set, before uvicorn waits for the responses under way (it ends them: nothing is left for
    uvicorn to cancel)."""
    root = logging.getLogger()
    log_filter = RequestIdLogFilter()
    for handler in root.handlers:
        handler.addFilter(log_filter)
    config = uvicorn.Config(
        AccessLog(TraceRequests(app) if tracing.enabled() else app),
        log_config=None,  # our logging setup, not uvicorn's
        log_level=root.level if log_level is None else log_level,
        access_log=False,  # AccessLog writes one line per request, after streaming
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="http")
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if serving.done():
            serving.result()
            return
        host, port = sock.getsockname()[:2]
        print(f"pdserve: serving http://{host}:{port}", flush=True)
        waiting = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if on_stop is not None:
            on_stop()
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        for handler in root.handlers:
            handler.removeFilter(log_filter)
        sock.close()
