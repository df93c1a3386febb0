"""An async Python client for the coordinator's client socket: submit a request, iterate its
events, abort it. One DEALER socket multiplexes any number of concurrent requests; it holds the
cluster keys (by default those `pdserve serve` made for this user) to be let in."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import zmq
import zmq.asyncio

from pdserve.cluster.client_messages import Cancel, Event, Submit, client_events, client_requests
from pdserve.cluster.codec import ProtocolError
from pdserve.cluster.keys import ClusterKeys, curve_client, default_key_dir
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.coordinator import SubmitError

T = TypeVar("T")

DEFAULT_KEYS = "default"  # the key set of default_key_dir(): `pdserve serve`'s for this user
# How long a request may go unfinished before the client gives up on the coordinator: past the
# coordinator's own request_timeout_s default (1800 s), whose timeout error should come first.
REQUEST_TIMEOUT_S = 1860.0


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        keys: ClusterKeys | str | None = DEFAULT_KEYS,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        """keys: the cluster's key set, a directory holding it, DEFAULT_KEYS ($PDSERVE_CLUSTER_KEYS
        or the per-user one `pdserve serve` makes), or None for a coordinator run --insecure.
        timeout_s: a request not finished this long after it was sent raises SubmitError
        "timeout" and is cancelled (the coordinator may be gone: nothing else would end it)."""
        if isinstance(keys, str):
            keys = ClusterKeys.load(default_key_dir() if keys == DEFAULT_KEYS else keys)
        self.address = address
        self.keys = keys
        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            curve_client(self.sock, keys)
        self.sock.connect(address)
        self.streams: dict[str, asyncio.Queue[Event]] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                event = client_events.decode(frames[-1])
            except ProtocolError:
                continue  # not ours; the coordinator sends nothing else
            if event.request_id in self.streams:
                self.streams[event.request_id].put_nowait(event)

    async def generate(
        self, token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[Event]:
        """Yields the request's events until it finishes; raises SubmitError if refused."""
        self._ensure_reader()
        request_id = request_id or f"client-{uuid.uuid4().hex[:16]}"
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self.streams[request_id] = queue
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        finished = False
        try:
            submit = client_requests.encode(Submit(request_id, list(token_ids), params))
            await self._within(self.sock.send(submit), deadline)
            while True:
                event = await self._within(queue.get(), deadline)
                if event.error is not None:
                    finished = True
                    raise SubmitError(event.error_code or "internal", event.error)
                yield event
                if event.finish_reason is not None:
                    finished = True
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished:  # the caller stopped reading: free its blocks everywhere
                with contextlib.suppress(zmq.ZMQError):  # (not queued if the queue is full)
                    await self.sock.send(client_requests.encode(Cancel(request_id)), zmq.NOBLOCK)

    async def _within(self, step: Awaitable[T], deadline: float) -> T:
        """A step of a request (its submit, its next event), or SubmitError "timeout" once the
        request's deadline has passed."""
        try:
            return await asyncio.wait_for(step, deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            raise SubmitError(
                "timeout",
                f"no answer from the coordinator at {self.address} within {self.timeout_s:g}s "
                "(it is gone, or the request is still waiting there)",
            ) from None

    async def complete(self, token_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
        """Collects a whole request: (output token ids, finish reason)."""
        tokens: list[int] = []
        reason = ""
        async for event in self.generate(token_ids, params):
            tokens += event.token_ids
            reason = event.finish_reason or reason
        return tokens, reason

    async def abort(self, request_id: str) -> None:
        await self.sock.send(client_requests.encode(Cancel(request_id)))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self.sock.close(0)
