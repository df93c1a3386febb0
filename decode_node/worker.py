"""The decode node: the continuous-batching step loop. It takes in sequences whose KV has fully
arrived from a prefill node, prefills short prompts itself when the coordinator says so, and sends
all new tokens of each step in one message.

The node loop (`pdserve.cluster.node_loop`) with the decode role: orders Generate, Admit,
StartDecode and Abort; before each step it takes in sequences whose KV has arrived, after it sends
the step's tokens.
"""

from __future__ import annotations

import logging

from pdserve.cluster import tracing
from pdserve.cluster.keys import node_keys
from pdserve.cluster.node_link import NodeLink, stop_on_signals
from pdserve.cluster.node_loop import IDLE_WAIT_MS, NodeLoop
from pdserve.cluster.node_messages import (
    Abort,
    Admit,
    Admitted,
    FinishReason,
    Generate,
    Heartbeat,
    Message,
    NodeRole,
    Register,
    RequestError,
    StartDecode,
    TokenItem,
    Tokens,
    TransferDone,
)
from pdserve.cluster.node_options import NodeOptions
from pdserve.cluster.node_reports import engine_heartbeat, engine_registration, wire_logprobs
from pdserve.decode_node.handoff import DecodeHandoff
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.llm_engine import Engine, LLMEngine, RequestOutput, RequestRejected
from pdserve.engine.sequence import Sequence
from pdserve.engine.tp.shard import kv_head_ranges
from pdserve.kv_transfer.base import KVReceiver, TransferResult, TransportFailed

logger = logging.getLogger(__name__)


class DecodeNode(NodeLoop):
    def __init__(
        self,
        engine: Engine,
        link: NodeLink,
        receiver: KVReceiver | None,
        role: NodeRole = NodeRole.DECODE,
    ) -> None:
        super().__init__(engine, link)
        self.role = role
        self.receiver = receiver  # None for a colocated worker that never receives KV
        # Traces (while tracing is on): each request's spans, the trace context its decode span
        # hangs from (the Admit's or Generate's), and the bytes of one KV block.
        self.spans = tracing.RequestSpans()
        self._trace_parents: dict[str, str] = {}
        traced = tracing.enabled()
        self._block_bytes = engine.layout.bytes_per_block if traced else 0
        on_end = self._kv_ended if traced else None
        self.handoff = (
            DecodeHandoff(receiver, engine.block_manager, on_end, engine.tiers, engine.scheduler.kv)
            if receiver
            else None
        )
        self._kv_error_logged = False

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Generate):
            self._traced(msg.request_id, msg.trace_context)
            self.spans.start(
                msg.request_id,
                "decode",
                msg.trace_context,
                {"pdserve.local_prefill": True, "pdserve.prompt_tokens": len(msg.token_ids)},
            )
            try:
                self.engine.add_request(
                    msg.request_id, msg.token_ids, msg.params, output_offset=msg.output_offset
                )
            except (RequestRejected, ValueError, TypeError) as exc:
                self._untrace(msg.request_id, str(exc))
                self.link.send(RequestError(msg.request_id, str(exc), retryable=False))
        elif isinstance(msg, Admit):
            self._admit(msg)
        elif isinstance(msg, StartDecode):
            seq = self.handoff.start(msg.request_id, msg.token_id) if self.handoff else None
            if seq is not None:
                self._run_arrived(seq)
        elif isinstance(msg, Abort):
            self._untrace(msg.request_id, "aborted")
            if self.handoff is None or not self.handoff.cancel(msg.request_id, msg.kv_unsent):
                self.engine.abort(msg.request_id)
        else:
            return False
        return True

    def reset(self) -> None:
        self.spans.end_every("the coordinator reset the node")
        self._trace_parents.clear()
        if self.handoff is not None:
            self.handoff.reset()

    def _admit(self, msg: Admit) -> None:
        self._traced(msg.request_id, msg.trace_context)
        self.spans.start(msg.request_id, "admission", msg.trace_context)
        blocks, num_reused = None, 0
        if self.handoff is not None:
            try:
                seq = self.engine.new_sequence(
                    msg.request_id, msg.token_ids, msg.params, msg.num_computed, msg.output_offset
                )
                blocks = self.handoff.reserve(
                    seq, msg.transfer_timeout_s, msg.reuse_prefix, msg.first_token_pending
                )
                if blocks is not None:
                    # Leading blocks of every group held here already: the sender skips them.
                    num_reused = seq.num_cached_tokens // self.engine.config.block_size
            except (RequestRejected, ValueError, TypeError, TransportFailed) as exc:
                logger.warning("[%s] admission refused: %s", msg.request_id, exc)
        if tracing.enabled():
            self._trace_admission(msg, blocks, num_reused)
        self.link.send(Admitted(msg.request_id, blocks is not None, blocks or [], num_reused))

    def _trace_admission(self, msg: Admit, blocks: list[int] | None, num_reused: int) -> None:
        """End the admission's span; open the KV transfer's, when blocks are to be received."""
        rid = msg.request_id
        if blocks is None:
            self._untrace(rid, "no room for its KV")
            return
        self.spans.end(
            rid,
            "admission",
            attributes={
                "pdserve.kv.blocks": len(blocks),
                "pdserve.kv.reused_blocks": num_reused,
                "pdserve.early_admission": msg.first_token_pending,
            },
        )
        if blocks:
            attributes = {
                "pdserve.kv.transport": self.receiver.name,
                "pdserve.kv.blocks": len(blocks),
                "pdserve.kv.bytes": len(blocks) * self._block_bytes,
            }
            self.spans.start(rid, "kv_transfer", msg.trace_context, attributes)

    def _kv_ended(self, result: TransferResult) -> None:
        """A KV transfer into this node ended: its span says how, and how its pages' digests
        checked out."""
        integrity = result.integrity or "unchecked"
        error = None if result.ok else result.error or "failed"
        self.spans.end(
            result.transfer_id, "kv_transfer", error, {"pdserve.kv.integrity": integrity}
        )
        if not result.ok:  # the request leaves this node (its blocks are freed)
            self._untrace(result.transfer_id, error)

    def _traced(self, request_id: str, trace_context: str) -> None:
        if trace_context and tracing.enabled():
            self._trace_parents[request_id] = trace_context

    def _untrace(self, request_id: str, error: str) -> None:
        """The request ended here other than by finishing: its open spans end with `error`."""
        if self._trace_parents.pop(request_id, None) is not None:
            self.spans.end_all(request_id, error)

    def take_in(self) -> None:
        """Sequences whose KV has all arrived start; failed handoffs are reported."""
        if self.handoff is None:
            return
        arrived, failed = self.handoff.poll()
        for seq in arrived:
            self._run_arrived(seq)
        for end in failed:
            self.link.send(end)
        if self.kv_error is not None and not self._kv_error_logged:
            logger.error("KV receiver failed; taking no more handoffs: %s", self.kv_error)
            self._kv_error_logged = True

    def _run_arrived(self, seq: Sequence) -> None:
        """Start a sequence whose KV (and first token) are all in."""
        try:
            self.engine.add_running(seq)
        except RequestRejected as exc:  # its id is taken: it cannot run here
            self.engine.block_manager.free(seq.block_table)
            self._untrace(seq.request_id, str(exc))
            self.link.send(TransferDone(seq.request_id, False, str(exc)))
            return
        parent = self._trace_parents.get(seq.request_id)
        if parent:
            self.spans.start(seq.request_id, "decode", parent)

    def report(self, outputs: list[RequestOutput]) -> None:
        """All of the step's new tokens, in one message."""
        for out in outputs:
            if out.error is not None:  # its constraint could not be compiled: nothing held
                self._untrace(out.request_id, out.error)
                self.link.send(RequestError(out.request_id, out.error, retryable=False))
        outputs = [o for o in outputs if o.error is None]
        if not outputs:
            return
        if self._trace_parents:
            self._trace_outputs(outputs)
        items = []
        for o in outputs:
            # Several tokens when a constraint forced some after the sampled one: an item each,
            # the finish reason on the last (forced tokens come without logprobs).
            *before, last = o.new_token_ids
            items += [TokenItem(o.request_id, token, None, None) for token in before]
            reason = FinishReason(o.finish_reason) if o.finished else None
            items.append(TokenItem(o.request_id, last, reason, wire_logprobs(o.logprobs)))
        self.link.send(Tokens(self.link.node_id, items))

    def _trace_outputs(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            if o.request_id not in self._trace_parents:
                continue
            self.spans.count(
                o.request_id, "decode", "pdserve.completion_tokens", len(o.new_token_ids)
            )
            if o.finished:
                del self._trace_parents[o.request_id]
                self.spans.end(
                    o.request_id, "decode", attributes={"pdserve.finish_reason": o.finish_reason}
                )

    @property
    def kv_error(self) -> str | None:
        """Why this node takes no more handoffs (its KV receiver failed), or None."""
        return self.handoff.failed if self.handoff is not None else None

    def idle_wait_ms(self) -> int:
        expecting = self.handoff is not None and self.handoff.num_pending > 0
        return 1 if expecting else IDLE_WAIT_MS  # KV arrivals are polled between steps

    def heartbeat(self) -> Heartbeat:
        beat = engine_heartbeat(self.engine, self.link.node_id, 0, self.kv_error)
        if self.handoff is not None:
            beat.pending_transfers = self.handoff.num_pending
            beat.kv_blocks_received = self.handoff.blocks_received
            beat.kv_bytes_received = (
                self.handoff.blocks_received * self.engine.layout.bytes_per_block
            )
            beat.kv_blocks_reused = self.handoff.blocks_reused
            beat.kv_integrity_failures = self.handoff.receiver.stats().get("integrity_failures", 0)
        return beat

    def registration(self) -> Register:
        info = self.receiver.info() if self.receiver is not None else {}
        transport = self.receiver.name if self.receiver is not None else "none"
        return engine_registration(self.engine, self.link.node_id, self.role, transport, info)

    def release(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


def serve(options: NodeOptions, engine_config: EngineConfig, colocated: bool = False) -> None:
    """Run a decode (or colocated) node process until shut down or signalled."""
    role = NodeRole.COLOCATED if colocated else NodeRole.DECODE
    tracing.setup(options.otlp_traces_endpoint, f"pdserve-{role.value}", node_id=options.node_id)
    receiver: KVReceiver | None = None
    keys = node_keys(options.cluster_keys, options.insecure)
    size = engine_config.tensor_parallel_size
    specs, remote = [], []
    if not colocated:
        from pdserve.kv_transfer.rank_endpoint import rank_endpoints

        # Every rank receives the pages of its heads, on a port of its own, keyed as rank 0's.
        specs, remote = rank_endpoints(
            "receiver",
            size,
            options.transport,
            options.kv_host,
            options.kv_port,
            options={"keys": keys, "encrypt": options.kv_encryption},
        )

    def pool_factory(layout: KVLayout, num_blocks: int) -> KVPool:
        nonlocal receiver
        if colocated:
            return KVPool(layout, num_blocks, engine_config.resolved_device())
        from pdserve.kv_transfer import make_receiver

        receiver = make_receiver(
            options.transport,
            layout,
            num_blocks,
            device=engine_config.resolved_device(),
            # Every transport's receiver has a control socket; tcp carries the pages on it too.
            address=f"tcp://{options.kv_host}:{options.kv_port}",
            keys=keys,
            encrypt=options.kv_encryption,
        )
        return receiver.pool

    engine = LLMEngine(engine_config, pool_factory=pool_factory, kv_endpoints=specs)
    if receiver is not None and size > 1:
        from pdserve.kv_transfer.sharded import ShardedReceiver

        heads = [(r.start, r.stop) for r in kv_head_ranges(size, engine.layout.num_kv_heads)]
        receiver = ShardedReceiver(receiver, remote, heads, engine.layout, engine.ranks.check)
    link = NodeLink(options.coordinator, options.node_id, options.heartbeat_interval_s, keys)
    node = DecodeNode(engine, link, receiver, role)
    stop_on_signals(node)
    logger.info(
        "%s node %s serving (transport %s)",
        role.value,
        options.node_id,
        receiver.name if receiver else "none",
    )
    try:
        node.run()
    finally:
        tracing.shutdown()  # the spans not yet exported go now
