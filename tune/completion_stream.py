"""One streamed OpenAI completions request, timed: Server-Sent Events are decoded line by line,
every chunk that carries a choice is a token chunk (its arrival time is a token's), and the final
`usage` chunk, when the server sends one, gives the exact token counts. Servers hold back tokens
whose text is not yet a whole character; asking for `logprobs` makes them send every token."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable

import httpx

from pdserve.tune.serving_metrics import RequestResult
from pdserve.tune.serving_workload import RequestSpec

DONE = "[DONE]"
# Server-Sent Events end a line with CRLF, LF or CR, and with nothing else: a JSON payload may
# hold U+2028, U+0085 or a form feed unescaped, which str.splitlines (and httpx's aiter_lines)
# would take for line ends.
LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an event stream from its text as it arrives, without their line ends."""
    pending = ""
    async for chunk in chunks:
        pending += chunk
        # A CR at the very end may be the first half of a CRLF: it waits for the next chunk.
        held = "\r" if pending.endswith("\r") else ""
        *lines, pending = LINE_END.split(pending[: len(pending) - len(held)])
        pending += held
        for line in lines:
            yield line
    if pending:
        yield pending.rstrip("\r")


class SSEDecoder:
    """Server-Sent Events: feed it lines (without their newline), get each event's data back when
    the blank line that ends the event arrives. Comments and fields other than data are skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data, for a stream that ends without the final blank line."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


class CompletionTimer:
    """The timing of one completion stream, fed one event payload at a time with its arrival."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: float | None = None
        self.last: float | None = None
        self.end: float | None = None
        self.itl: list[float] = []
        self.token_chunks = 0
        self.tokens = 0  # one a chunk, or as many as the chunk's logprobs list
        self.usage: dict | None = None
        self.error = ""
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == DONE:
            self.done = True
            self.end = now
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"not JSON: {data[:200]!r}"
            return
        if obj.get("error"):
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        if not choice.get("text") and choice.get("finish_reason") is not None:
            self.end = now  # an empty closing chunk carries no token
            return
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.token_chunks += 1
        logprobs = choice.get("logprobs") or {}
        self.tokens += len(logprobs.get("tokens") or ()) or 1

    def result(self, spec: RequestSpec, send_time: float, now: float) -> RequestResult:
        end = self.end if self.end is not None else now
        usage = self.usage or {}
        output_len = int(usage.get("completion_tokens") or self.tokens)
        success = not self.error and self.first is not None
        return RequestResult(
            success=success,
            prompt_len=int(usage.get("prompt_tokens") or spec.prompt_len),
            output_len=output_len if success else 0,
            expected_output_len=spec.output_len,
            kind=spec.kind,
            send_time=send_time,
            ttft=(self.first - self.start) if self.first is not None else 0.0,
            latency=end - self.start,
            itl=self.itl,
            error=self.error or ("" if success else "the stream carried no token"),
        )


def completion_body(
    spec: RequestSpec, model: str | None, include_usage: bool, extra: dict | None = None
) -> dict:
    body = {
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,  # so the output length is the workload's, not the model's choice
    }
    if model is not None:
        body["model"] = model
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return {**body, **(extra or {})}


async def send_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    spec: RequestSpec,
    run_start: float,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestResult:
    """POST one streaming completion and time it; failures come back as unsuccessful results."""
    start = clock()
    timer = CompletionTimer(start)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                timer.error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                decoder = SSEDecoder()
                async for line in sse_lines(response.aiter_text()):
                    data = decoder.feed(line)
                    if data is not None:
                        timer.on_event(data, clock())
                    if timer.done or timer.error:
                        break
                if not timer.done and (data := decoder.flush()) is not None:
                    timer.on_event(data, clock())
    except httpx.HTTPError as exc:
        timer.error = f"{type(exc).__name__}: {exc}"
    return timer.result(spec, start - run_start, clock())
