"""The prefill node: batches prompts (chunked, prefix-cached), reports each first token as soon as
it is sampled, and ships the sequence's KV pages to the decode node the coordinator admitted it to.

Loop: receive orders -> step the engine -> report first tokens -> report ended handoffs ->
heartbeat. SendKV usually arrives on the handoff socket instead (`handoff_socket.py`), whose
thread starts the send during a step; `PrefillHandoff` keeps the two from deciding about the same
sequence at once, and only the loop frees blocks or talks on the main socket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.cluster.keys import node_keys
from pdserve.cluster.node_link import NodeLink, stop_on_signals
from pdserve.cluster.node_messages import (
    Abort,
    FinishReason,
    FirstToken,
    Message,
    NodeRole,
    Prefill,
    RequestError,
    Reset,
    SendKV,
    Shutdown,
    TransferDone,
)  # fmt: skip
from pdserve.cluster.node_options import NodeOptions
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVPool
from pdserve.engine.llm_engine import Engine, LLMEngine, RequestOutput, RequestRejected
from pdserve.engine.node_reports import engine_heartbeat, engine_registration, wire_logprobs
from pdserve.engine.tp_shard import kv_head_ranges
from pdserve.kv_transfer.base import KVSender
from pdserve.kv_transfer.handoff import PrefillHandoff
from pdserve.prefill_node.handoff_socket import HandoffSocket
from pdserve.prefill_node.layer_stream import LayerStream

logger = logging.getLogger(__name__)


class PrefillNode:
    def __init__(
        self,
        engine: Engine,
        link: NodeLink,
        transport: str,
        make_sender: Callable[[str, KVPool], KVSender] | None = None,
    ) -> None:
        """make_sender(transport, pool): a KV sender (default: `kv_transfer.make_sender`)."""
        self.engine = engine
        self.link = link
        self.transport = transport
        self.handoff = PrefillHandoff(
            engine.block_manager, engine.pool, transport, make_sender, engine.layout.num_layers
        )
        self.handoff_socket: HandoffSocket | None = None
        self.layer_stream: LayerStream | None = None
        self.running = True

    def handle(self, msg: Message) -> None:
        if isinstance(msg, Prefill):
            try:
                self.engine.add_request(
                    msg.request_id, msg.token_ids, msg.params, True, msg.output_offset
                )
            except (RequestRejected, ValueError, TypeError) as exc:
                self.link.send(RequestError(msg.request_id, str(exc), retryable=False))
                return
            if msg.stream_kv:
                self.handoff.expect_stream(msg.request_id)
        elif isinstance(msg, SendKV):
            self.send_kv(msg)
        elif isinstance(msg, Abort):
            # A streaming prefill may be in both: the engine frees its blocks, the handoff its
            # own once no send reads them.
            self.handoff.abort(msg.request_id)
            self.engine.abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, Reset):
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
            self.handoff.reset()
            self.register()
            if self.handoff_socket is not None:
                self.handoff_socket.announce()
        else:
            logger.warning("prefill node ignores %s", msg.TYPE)

    def stream_layers(self) -> bool:
        """Send streaming prefills' pages layer by layer during their last chunk's forward
        (False: they leave in one send after the step, as without streaming)."""
        runner = getattr(self.engine, "runner", None)
        if runner is None or getattr(self.engine, "ranks", None) is not None:
            # Under tensor parallelism rank 0's layer is not the other ranks' layer: their
            # pages leave after the step, each rank's sender reading its own heads.
            logger.info("layer-wise KV sends are off (tensor parallelism or no model runner)")
            return False
        self.layer_stream = LayerStream(self.handoff)
        self.engine.on_schedule = self.layer_stream.begin
        runner.on_layer = self.layer_stream.layer_done
        return True

    def send_kv(self, msg: SendKV) -> None:
        """Start shipping a prefilled sequence's KV; safe from the handoff socket's thread."""
        self.handoff.send(
            msg.request_id, msg.decode_node, msg.receiver_info, msg.dst_blocks,
            msg.transfer_timeout_s, msg.skip_blocks, msg.prefilling,
        )  # fmt: skip

    def _report_first_tokens(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            if out.held_blocks is not None:
                self.handoff.hold(out.request_id, out.held_blocks)
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
                    num_blocks=len(out.held_blocks) if out.held_blocks is not None else 0,
                    logprobs=wire_logprobs(out.logprobs),
                )
            )

    def _report_handoffs(self) -> None:
        for end in self.handoff.poll():
            self.link.send(TransferDone(end.request_id, end.ok, end.error))

    def register(self) -> None:
        reg = engine_registration(self.engine, self.link.node_id, NodeRole.PREFILL, "none", {})
        self.link.register(reg)

    def step(self) -> None:
        busy = self.engine.has_unfinished() or self.handoff.num_pending > 0
        self.before_step(self.link.receive(0 if busy else 5))
        self.after_step(self.engine.step() if self.engine.has_unfinished() else [])

    # The loop's two halves around the engine's step, which a simulator drives on its own clock.

    def before_step(self, orders: list[Message]) -> None:
        """Carry out the orders received since the last step."""
        for msg in orders:
            self.link.carry_out(msg, self.handle)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Report the step's first tokens and the handoffs that ended; refresh the load report."""
        self._report_first_tokens(outputs)
        self._report_handoffs()
        if self.link.load_due():
            self.engine.check_alive()  # a dead rank takes the node down, idle or not
            self.link.set_load(
                engine_heartbeat(self.engine, self.link.node_id, self.handoff.num_pending)
            )

    def run(self) -> None:
        self.register()
        if self.handoff_socket is not None:
            self.handoff_socket.start()
        while self.running:
            self.step()
        self.close()

    def close(self) -> None:
        if self.handoff_socket is not None:
            self.handoff_socket.close()
        self.handoff.close()
        self.link.close()


def serve(options: NodeOptions, engine_config: EngineConfig) -> None:
    """Run a prefill node process until the coordinator shuts it down or a signal arrives."""
    from pdserve.kv_transfer import make_sender
    from pdserve.kv_transfer.rank_endpoint import rank_endpoints
    from pdserve.kv_transfer.sharded import ShardedSender

    keys = node_keys(options.cluster_keys, options.insecure)
    size = engine_config.tensor_parallel_size
    # Every rank sends the pages of its heads, holding the node's keys.
    specs, links = rank_endpoints("sender", size, options={"keys": keys})
    engine = LLMEngine(engine_config, kv_endpoints=specs)
    heads = [(r.start, r.stop) for r in kv_head_ranges(size, engine.layout.num_kv_heads)]

    def sender(transport: str, pool: KVPool) -> KVSender:
        # Sharded even at one rank: it routes heads to a decode node of any TP size.
        return ShardedSender(make_sender(transport, pool, keys=keys), links, heads, engine.layout)

    link = NodeLink(options.coordinator, options.node_id, options.heartbeat_interval_s, keys)
    node = PrefillNode(engine, link, options.transport, sender)
    node.stream_layers()
    if options.kv_handoff == "immediate":
        node.handoff_socket = HandoffSocket(
            options.coordinator, options.node_id, node.send_kv, keys
        )
    stop_on_signals(node)
    logger.info("prefill node %s serving (transport %s, KV handoff %s)",
                options.node_id, options.transport, options.kv_handoff)  # fmt: skip
    node.run()
