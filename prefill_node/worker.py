"""The prefill node: batches prompts (chunked, prefix-cached), reports each first token as soon as
it is sampled, and ships the sequence's KV pages to the decode node the coordinator admitted it to.

Loop: receive messages -> step the engine -> report first tokens -> poll sends -> heartbeat.
SendKV usually arrives on the handoff socket instead (`prefill_node/handoff.py`), whose thread
starts the send during a step; a lock keeps that thread and the loop from deciding about the same
sequence at once, and only the loop frees blocks or talks on the main socket.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from engine import protocol
from engine.llm_engine import LLMEngine, RequestOutput, RequestRejected
from engine.node_link import NodeLink, stop_on_signals
from engine.node_options import NodeOptions
from engine.protocol import (
    Abort,
    FirstToken,
    Prefill,
    RequestError,
    Reset,
    SendKV,
    Shutdown,
    TransferDone,
)
from engine.sampling_params import SamplingParams
from kv_transfer import KVSender, make_sender
from prefill_node.handoff import HandoffListener

logger = logging.getLogger(__name__)


class PrefillNode:
    def __init__(
        self, engine: LLMEngine, link: NodeLink, transport: str, sender_options: dict | None = None
    ) -> None:
        self.engine = engine
        self.link = link
        self.transport = transport
        self.sender_options = sender_options or {}
        # One sender per transport, made on first use: each decode node's receiver says which
        # transport it speaks (a deployment may mix cuda_ipc within a host and nccl across).
        self.senders: dict[str, KVSender] = {}
        self.connected: set[tuple[str, str]] = set()
        self.sending: set[str] = set()  # prefilled sequences whose KV is on its way
        self.running = True
        self.handoff: HandoffListener | None = None
        # Held by whoever reads or changes `sending`, `senders` or a prefilled sequence's fate.
        self._lock = threading.Lock()
        # Sends that could not start: (request id, error, free its blocks), for the loop to settle.
        self._failed_starts: deque[tuple[str, str, bool]] = deque()

    def handle(self, msg: protocol.Message) -> None:
        if isinstance(msg, Prefill):
            try:
                params = SamplingParams.from_dict(msg.params)
                self.engine.add_request(
                    msg.request_id, msg.token_ids, params, True, msg.generator_offset
                )
            except (RequestRejected, ValueError, TypeError) as exc:
                self.link.send(RequestError(msg.request_id, str(exc), retryable=False))
        elif isinstance(msg, SendKV):
            self.start_send(msg)
            self._settle_failed_starts()
        elif isinstance(msg, Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, Reset):
            for request_id in list(self.engine.seqs):
                self._abort(request_id)
            self.link.register(self.engine, self.transport)
            if self.handoff is not None:
                self.handoff.announce()
        else:
            logger.warning("prefill node ignores %s", msg.TYPE)

    def start_send(self, msg: SendKV) -> None:
        """Start shipping a prefilled sequence's KV; safe from the handoff thread during a step
        (the sequence is finished, so the step neither reads nor changes its blocks)."""
        with self._lock:
            seq = self.engine.seqs.get(msg.request_id)
            if seq is None or seq.finish_reason != "prefilled" or msg.request_id in self.sending:
                self._failed_starts.append((msg.request_id, "no prefilled KV held here", False))
                return
            try:
                sender = self._sender_for(msg.receiver_info.get("transport", self.transport))
                if (sender.name, msg.decode_node) not in self.connected:
                    sender.connect(msg.decode_node, msg.receiver_info)
                    self.connected.add((sender.name, msg.decode_node))
                sender.send(
                    msg.request_id, msg.decode_node, list(seq.block_table), list(msg.dst_blocks)
                )
            except Exception as exc:  # a bad peer must not take the node down
                logger.exception("[%s] send to %s failed to start", msg.request_id, msg.decode_node)
                self._failed_starts.append((msg.request_id, f"send failed: {exc}", True))
                return
            self.sending.add(msg.request_id)

    def _settle_failed_starts(self) -> None:
        while self._failed_starts:
            request_id, error, release = self._failed_starts.popleft()
            if release:
                with self._lock:
                    if request_id not in self.sending and request_id in self.engine.seqs:
                        self.engine.release(request_id)
            self.link.send(TransferDone(request_id, False, error))

    def _abort(self, request_id: str) -> None:
        with self._lock:
            seq = self.engine.seqs.get(request_id)
            if seq is None or request_id in self.sending:
                return  # unknown, or its blocks are freed when the send in flight ends
            if seq.finish_reason == "prefilled":
                self.engine.release(request_id)
            else:
                self.engine.abort(request_id)

    def _report_first_tokens(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            prefilled = out.finish_reason == "prefilled"
            blocks = len(self.engine.seqs[out.request_id].block_table) if prefilled else 0
            self.link.send(
                FirstToken(
                    request_id=out.request_id,
                    token_id=out.new_token_ids[0],
                    # None: decode continues; "stop"/"length": it ended at its first token.
                    finish_reason=None if prefilled else out.finish_reason,
                    num_cached_tokens=out.num_cached_tokens,
                    num_blocks=blocks,
                    logprobs=out.logprobs[0] if out.logprobs else None,
                )
            )

    def _sender_for(self, transport: str) -> KVSender:
        if transport not in self.senders:
            self.senders[transport] = make_sender(
                transport, self.engine.pool, **self.sender_options
            )
        return self.senders[transport]

    def _poll_sends(self) -> None:
        with self._lock:
            results = [r for sender in self.senders.values() for r in sender.poll()]
            for result in results:
                self.sending.discard(result.transfer_id)
                if result.transfer_id in self.engine.seqs:
                    self.engine.release(result.transfer_id)
        for result in results:
            self.link.send(TransferDone(result.transfer_id, result.ok, result.error))

    def step(self) -> None:
        busy = self.engine.has_unfinished() or bool(self.sending)
        for msg in self.link.receive(0 if busy else 5):
            self.handle(msg)
        if self.engine.has_unfinished():
            self._report_first_tokens(self.engine.step())
        self._settle_failed_starts()
        self._poll_sends()
        self.link.update_load(self.engine, len(self.sending))

    def run(self) -> None:
        self.link.register(self.engine, self.transport)
        if self.handoff is not None:
            self.handoff.start()
        while self.running:
            self.step()
        self.close()

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        with self._lock:
            for sender in self.senders.values():
                sender.close()
        self.link.close()


def serve(options: NodeOptions) -> None:
    """Run a prefill node process until the coordinator shuts it down or a signal arrives."""
    engine = LLMEngine(options.engine)
    link = NodeLink(options.coordinator, options.node_id, "prefill", options.heartbeat_interval_s)
    node = PrefillNode(engine, link, options.transport)
    if options.kv_handoff == "immediate":
        node.handoff = HandoffListener(options.coordinator, options.node_id, node.start_send)
    stop_on_signals(node)
    logger.info("prefill node %s serving (transport %s, KV handoff %s)",
                options.node_id, options.transport, options.kv_handoff)  # fmt: skip
    node.run()
