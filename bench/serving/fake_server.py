"""A stand-in OpenAI completions server for testing the load generator: it streams `max_tokens`
one-token chunks, the first after `ttft_s` and the rest every `tpot_s`, with usage on request.

    python -m pdserve.bench.serving.fake_server --port 8100 --ttft-ms 50 --tpot-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def create_app(ttft_s: float = 0.02, tpot_s: float = 0.005, model: str = "fake") -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        body = await request.json()
        prompt = body.get("prompt", "")
        if not prompt:
            return JSONResponse({"error": {"message": "the prompt is empty"}}, status_code=400)
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        max_tokens = int(body.get("max_tokens", 16))
        usage = (body.get("stream_options") or {}).get("include_usage", False)

        async def events() -> AsyncIterator[str]:
            created = int(time.time())

            def chunk(text: str, finish: str | None) -> str:
                choice = {"index": 0, "text": text, "finish_reason": finish}
                obj = {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                return f"data: {json.dumps(obj)}\n\n"

            await asyncio.sleep(ttft_s)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(tpot_s)
                yield chunk(f" t{i}", None)
            yield chunk("", "length")
            if usage:
                counts = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max_tokens,
                    "total_tokens": prompt_tokens + max_tokens,
                }
                yield f"data: {json.dumps({'choices': [], 'usage': counts})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--tpot-ms", type=float, default=5.0)
    args = parser.parse_args(argv)
    app = create_app(args.ttft_ms / 1e3, args.tpot_ms / 1e3)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
