"""The decode node: the continuous-batching step loop. It takes in sequences whose KV has fully
arrived from a prefill node, prefills short prompts itself when the coordinator says so, and sends
all new tokens of each step in one message.

Loop: receive messages -> poll arriving KV -> step the engine -> send tokens -> heartbeat.
"""

from __future__ import annotations

import logging

from engine import protocol
from engine.kv_cache import KVLayout, KVPool
from engine.llm_engine import LLMEngine, RequestRejected
from engine.node_link import NodeLink, stop_on_signals
from engine.node_options import NodeOptions
from engine.protocol import (
    Abort,
    Admit,
    Admitted,
    Generate,
    RequestError,
    Reset,
    Shutdown,
    Tokens,
    TransferDone,
)
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer.base import KVReceiver

logger = logging.getLogger(__name__)


class DecodeNode:
    def __init__(
        self,
        engine: LLMEngine,
        link: NodeLink,
        receiver: KVReceiver | None,
        transfer_timeout_s: float = 30.0,
        transport: str = "none",
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.link = link
        self.receiver = receiver  # None for a colocated worker that never receives KV
        self.transfer_timeout_s = transfer_timeout_s
        self.incoming: dict[str, Sequence] = {}  # blocks reserved, KV on its way
        self.cancelled: set[str] = set()  # aborted while their KV was arriving
        self.running = True

    def handle(self, msg: protocol.Message) -> None:
        if isinstance(msg, Generate):
            try:
                params = SamplingParams.from_dict(msg.params)
                self.engine.add_request(
                    msg.request_id, msg.token_ids, params, generator_offset=msg.generator_offset
                )
            except (RequestRejected, ValueError, TypeError) as exc:
                self.link.send(RequestError(msg.request_id, str(exc), retryable=False))
        elif isinstance(msg, Admit):
            self._admit(msg)
        elif isinstance(msg, Abort):
            if msg.request_id in self.incoming and msg.kv_unsent:
                # No sender was asked for this KV: nothing can write into the blocks.
                self.receiver.cancel(msg.request_id, "aborted before its KV was sent")
                self.engine.drop_transfer(self.incoming.pop(msg.request_id))
                self.cancelled.discard(msg.request_id)
            elif msg.request_id in self.incoming:
                # The sender may still be writing into its blocks: free them once it ends.
                self.cancelled.add(msg.request_id)
            else:
                self.engine.abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, Reset):
            self.cancelled.update(self.incoming)
            for request_id in list(self.engine.seqs):
                if request_id not in self.incoming:
                    self.engine.abort(request_id)
            self._register()
        else:
            logger.warning("decode node ignores %s", msg.TYPE)

    def _admit(self, msg: Admit) -> None:
        if self.receiver is None:
            self.link.send(Admitted(msg.request_id, False))
            return
        try:
            params = SamplingParams.from_dict(msg.params)
            seq = self.engine.reserve_transfer(
                msg.request_id, msg.token_ids, msg.num_computed, params, msg.generator_offset
            )
        except (RequestRejected, ValueError, TypeError) as exc:
            logger.warning("[%s] admission refused: %s", msg.request_id, exc)
            seq = None
        if seq is None:
            self.link.send(Admitted(msg.request_id, False))
            return
        self.receiver.expect(
            msg.request_id, list(seq.block_table), timeout_s=self.transfer_timeout_s
        )
        self.incoming[msg.request_id] = seq
        self.link.send(Admitted(msg.request_id, True, list(seq.block_table)))

    def _poll_arrivals(self) -> None:
        if self.receiver is None:
            return
        for result in self.receiver.poll():
            seq = self.incoming.pop(result.transfer_id, None)
            if seq is None:
                continue
            cancelled = result.transfer_id in self.cancelled
            self.cancelled.discard(result.transfer_id)
            if result.ok and not cancelled:
                self.engine.start_transferred(seq)
            else:
                self.engine.drop_transfer(seq)
                if not result.ok:
                    logger.warning("[%s] KV arrival failed: %s", seq.request_id, result.error)
                    self.link.send(TransferDone(seq.request_id, False, result.error))

    def step(self) -> None:
        busy = self.engine.has_unfinished() or bool(self.incoming)
        for msg in self.link.receive(0 if self.engine.has_unfinished() else (1 if busy else 5)):
            self.handle(msg)
        self._poll_arrivals()
        if self.engine.has_unfinished():
            outputs = self.engine.step()
            if outputs:
                items = [
                    [o.request_id, o.new_token_ids[0], o.finish_reason if o.finished else None,
                     o.logprobs[0] if o.logprobs else None]
                    for o in outputs
                ]  # fmt: skip
                self.link.send(Tokens(self.link.node_id, items))
        self.link.update_load(self.engine, len(self.incoming))

    def _register(self) -> None:
        info = self.receiver.info() if self.receiver is not None else {}
        self.link.register(self.engine, self.transport, info)

    def run(self) -> None:
        self._register()
        while self.running:
            self.step()
        self.close()

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.link.close()


def serve(options: NodeOptions, colocated: bool = False) -> None:
    """Run a decode (or colocated) node process until shut down or signalled."""
    receiver: KVReceiver | None = None

    def pool_factory(layout: KVLayout, num_blocks: int) -> KVPool:
        nonlocal receiver
        if colocated:
            return KVPool(layout, num_blocks, options.engine.resolved_device())
        from kv_transfer import make_receiver

        receiver = make_receiver(
            options.transport,
            layout,
            num_blocks,
            device=options.engine.resolved_device(),
            **receiver_options(options),
        )
        return receiver.pool

    engine = LLMEngine(options.engine, pool_factory=pool_factory)
    role = "colocated" if colocated else "decode"
    link = NodeLink(options.coordinator, options.node_id, role, options.heartbeat_interval_s)
    transport = "none" if colocated else options.transport
    node = DecodeNode(engine, link, receiver, options.transfer_timeout_s, transport)
    stop_on_signals(node)
    logger.info("%s node %s serving (transport %s)", role, options.node_id, transport)
    node.run()


def receiver_options(options: NodeOptions) -> dict:
    # Every transport's receiver has a control socket; tcp carries the pages on it too.
    return {"address": f"tcp://{options.kv_host}:{options.kv_port}"}
