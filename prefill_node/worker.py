"""The prefill node: batches prompts (chunked, prefix-cached), reports each first token as soon as
it is sampled, and ships the sequence's KV pages to the decode node the coordinator admitted it to.

The node loop (`pdserve.cluster.node_loop`) with the prefill role: orders Prefill, SendKV and
Abort; after each step it reports first tokens and ended handoffs. SendKV usually arrives on the
handoff socket instead (`handoff_socket.py`), whose thread starts the send during a step;
`PrefillHandoff` keeps the two from deciding about the same sequence at once, and only the loop
frees blocks or talks on the main socket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from pdserve.cluster import tracing
from pdserve.cluster.keys import node_keys
from pdserve.cluster.node_link import NodeLink, stop_on_signals
from pdserve.cluster.node_loop import IDLE_WAIT_MS, NodeLoop
from pdserve.cluster.node_messages import (
    Abort,
    FinishReason,
    FirstToken,
    Heartbeat,
    Message,
    NodeRole,
    Prefill,
    Register,
    RequestError,
    SendKV,
)
from pdserve.cluster.node_options import NodeOptions
from pdserve.cluster.node_reports import engine_heartbeat, engine_registration, wire_logprobs
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.kv.kv_manager import live_blocks
from pdserve.engine.llm_engine import Engine, LLMEngine, RequestOutput, RequestRejected
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.tp.model_shard import ModelShard
from pdserve.engine.tp.shard import kv_head_ranges
from pdserve.kv_transfer.base import KVSender
from pdserve.prefill_node.handoff import PrefillHandoff
from pdserve.prefill_node.handoff_socket import HandoffSocket
from pdserve.prefill_node.layer_stream import LayerStream

logger = logging.getLogger(__name__)


class PrefillNode(NodeLoop):
    def __init__(
        self,
        engine: Engine,
        link: NodeLink,
        transport: str,
        make_sender: Callable[[str, KVPool], KVSender] | None = None,
    ) -> None:
        """make_sender(transport, pool): a KV sender (default: `kv_transfer.make_sender`)."""
        super().__init__(engine, link)
        self.transport = transport
        self.handoff = PrefillHandoff(
            engine.block_manager,
            engine.pool,
            transport,
            make_sender,
            engine.layout.num_slots,
            engine.layout.groups.slots_done_after,
        )
        self.handoff_socket: HandoffSocket | None = None
        self.layer_stream: LayerStream | None = None
        # Traces (while tracing is on): each request's spans, and the bytes of one KV block.
        self.spans = tracing.RequestSpans()
        self._block_bytes = engine.layout.bytes_per_block if tracing.enabled() else 0
        if tracing.enabled():
            self.engine.on_schedule = self._scheduled

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Prefill):
            attributes = {"pdserve.prompt_tokens": len(msg.token_ids)}
            self.spans.start(msg.request_id, "prefill", msg.trace_context, attributes)
            self.spans.start(msg.request_id, "queue", None, within="prefill")
            try:
                self.engine.add_request(
                    msg.request_id, msg.token_ids, msg.params, True, msg.output_offset
                )
            except (RequestRejected, ValueError, TypeError) as exc:
                self.spans.end_all(msg.request_id, str(exc))
                self.link.send(RequestError(msg.request_id, str(exc), retryable=False))
                return True
            if msg.stream_kv:
                self.handoff.expect_stream(msg.request_id)
        elif isinstance(msg, SendKV):
            self.send_kv(msg)
        elif isinstance(msg, Abort):
            self.spans.end_all(msg.request_id, "aborted")
            # A streaming prefill may be in both: the engine frees its blocks, the handoff its
            # own once no send reads them.
            self.handoff.abort(msg.request_id)
            self.engine.abort(msg.request_id)
        else:
            return False
        return True

    def stream_layers(self, shard: ModelShard) -> None:
        """Send streaming prefills' pages layer by layer during their last chunk's forward
        (rank 0's shard: under tensor parallelism each rank sends its heads of a layer once its
        own forward has it); without this they leave in one send after the step."""
        self.layer_stream = LayerStream(self.handoff, self.engine.scheduler.kv)
        self.engine.on_schedule = self._scheduled
        shard.add_layer_hook(self.layer_stream.layer_done)

    def _scheduled(self, out: SchedulerOutput) -> None:
        """A step's plan, before its forward: streaming prefills learn their last chunk; each
        traced prefill leaves its queue (first chunk) and counts its chunks."""
        if self.layer_stream is not None:
            self.layer_stream.begin(out)
        if tracing.enabled():
            for scheduled in out.scheduled:
                request_id = scheduled.seq.request_id
                self.spans.end(request_id, "queue")
                self.spans.count(request_id, "prefill", "pdserve.prefill.chunks")

    def send_kv(self, msg: SendKV) -> None:
        """Start shipping a prefilled sequence's KV; safe from the handoff socket's thread."""
        if msg.trace_context and tracing.enabled():
            sent = len(msg.dst_blocks)
            attributes = {
                "pdserve.kv.transport": msg.receiver_info.get("transport", self.transport),
                "pdserve.kv.blocks": sent,
                "pdserve.kv.bytes": sent * self._block_bytes,
                "pdserve.decode_node": msg.decode_node,
            }
            self.spans.start(msg.request_id, "kv_send", msg.trace_context, attributes)
        self.handoff.send(
            msg.request_id,
            msg.decode_node,
            msg.receiver_info,
            msg.dst_blocks,
            msg.transfer_timeout_s,
            msg.skip_blocks,
            msg.prefilling,
        )

    def idle_wait_ms(self) -> int:
        return 0 if self.handoff.num_pending > 0 else IDLE_WAIT_MS  # sends to see through

    def report(self, outputs: list[RequestOutput]) -> None:
        """The step's first tokens, then the handoffs that ended."""
        for out in outputs:
            if out.error is not None:  # its constraint could not be compiled: nothing held
                self.spans.end_all(out.request_id, out.error)
                self.link.send(RequestError(out.request_id, out.error, retryable=False))
                continue
            if not out.finished:
                continue
            self.spans.end(
                out.request_id,
                "prefill",
                attributes={"pdserve.cached_tokens": out.num_cached_tokens},
            )
            if out.held_tables is not None:
                self.handoff.hold(out.request_id, out.held_tables)
            elif self.handoff.holds(out.request_id):
                # A streaming prefill whose first token ended it: its sends are not needed.
                self.handoff.abort(out.request_id)
            reason = FinishReason(out.finish_reason) if out.finish_reason else None
            self.link.send(
                FirstToken(
                    request_id=out.request_id,
                    token_id=out.new_token_ids[0],
                    finish_reason=reason,  # None: decode continues elsewhere
                    num_cached_tokens=out.num_cached_tokens,
                    num_blocks=len(live_blocks(out.held_tables)) if out.held_tables else 0,
                    logprobs=wire_logprobs(out.logprobs),
                )
            )
        for end in self.handoff.poll():
            self.spans.end(end.request_id, "kv_send", None if end.ok else end.error or "failed")
            self.link.send(end)

    def heartbeat(self) -> Heartbeat:
        beat = engine_heartbeat(self.engine, self.link.node_id, self.handoff.num_pending)
        beat.kv_bytes_sent = self.handoff.blocks_sent * self.engine.layout.bytes_per_block
        return beat

    def registration(self) -> Register:
        return engine_registration(self.engine, self.link.node_id, NodeRole.PREFILL, "none", {})

    def reset(self) -> None:
        self.spans.end_every("the coordinator reset the node")
        self.handoff.reset()

    def register(self) -> None:
        super().register()
        if self.handoff_socket is not None:
            self.handoff_socket.announce()  # (again, after a reset) once registered

    def start(self) -> None:
        if self.handoff_socket is not None:
            self.handoff_socket.start()

    def release(self) -> None:
        if self.handoff_socket is not None:
            self.handoff_socket.close()
        self.handoff.close()


def serve(options: NodeOptions, engine_config: EngineConfig) -> None:
    """Run a prefill node process until the coordinator shuts it down or a signal arrives."""
    tracing.setup(options.otlp_traces_endpoint, "pdserve-prefill", node_id=options.node_id)
    from pdserve.kv_transfer.rank_endpoint import rank_endpoints
    from pdserve.kv_transfer.sharded import ShardedSender, rank_links

    keys = node_keys(options.cluster_keys, options.insecure)
    size = engine_config.tensor_parallel_size
    # Every rank sends the pages of its heads, holding the node's keys, with their digests.
    sender_options = {"keys": keys, "integrity": options.kv_integrity}
    specs, remote = rank_endpoints("sender", size, options=sender_options)
    speculation = engine_config.speculation()
    if speculation is not None and speculation.method == "draft_model":
        # A prefill node samples one token a request and never speculates: no draft to load.
        engine_config = replace(engine_config, speculative_config=None)
    engine = LLMEngine(engine_config, kv_endpoints=specs)
    heads = [(r.start, r.stop) for r in kv_head_ranges(size, engine.layout.num_kv_heads)]
    links = rank_links(engine.pool, remote, sender_options)
    # Rank 0's progress reaches its own worker before its layer stream sends (hooks run in turn).
    engine.shard.add_layer_hook(lambda layer: links.layer_done(engine.runner.step_index, layer))

    def sender(transport: str, pool: KVPool) -> KVSender:
        # Sharded even at one rank: it routes heads to a decode node of any TP size.
        progress = engine.runner.layer_in_progress
        return ShardedSender(transport, pool, links, heads, engine.layout, progress)

    link = NodeLink(options.coordinator, options.node_id, options.heartbeat_interval_s, keys)
    node = PrefillNode(engine, link, options.transport, sender)
    node.stream_layers(engine.shard)
    if options.kv_handoff == "immediate":
        node.handoff_socket = HandoffSocket(
            options.coordinator, options.node_id, node.send_kv, keys
        )
    stop_on_signals(node)
    logger.info(
        "prefill node %s serving (transport %s, KV handoff %s)",
        options.node_id,
        options.transport,
        options.kv_handoff,
    )
    try:
        node.run()
    finally:
        tracing.shutdown()  # the spans not yet exported go now
