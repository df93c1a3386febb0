"""A prefill node's KV handoffs: hold a prefilled sequence's blocks, send them when the
coordinator says where (from the loop or the handoff socket's thread), free them when the send
ends or the request is aborted. The node's loop asks and polls; nothing here blocks on the
network, so the step loop never waits on a peer. Blocks are freed only by the loop's calls (hold,
abort, poll), never by another thread: the block manager is the loop's.

A handoff's states and their moves are the decode node's too (`pdserve.cluster.handoff_state`);
its record (`Handoff`) is this side's own: what sending needs (the route, the layers handed to
the transport, the sends not ended), where the decode side's holds what receiving needs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.handoff_state import HandoffState
from pdserve.cluster.node_messages import TransferDone
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.kv.kv_manager import handoff_blocks, live_blocks
from pdserve.kv_transfer.base import KVSend, KVSender

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Route:
    """Where a prefilled sequence's KV goes (from the coordinator's SendKV)."""

    decode_node: str
    receiver_info: dict
    dst_blocks: list[int]
    timeout_s: float
    skip_blocks: int = 0  # leading blocks the decode node holds already: not sent


@dataclass(slots=True)
class Handoff:
    """The sending side's handoff of one request: PREFILLING or HELD, then SENDING."""

    request_id: str
    # The sequence's block tables, a table per KV group, FREED (-1) where the decode side reads
    # nothing: one reference on each block, owned by the handoff (none while PREFILLING).
    tables: list[list[int]]
    state: HandoffState
    # The destination, the pool's slots [0, next_layer) handed to the transport (a slot per
    # layer, or per layer of the largest KV group), the sends not yet
    # ended, the first error, and whether the engine is done with the sequence.
    route: Route | None = None
    next_layer: int = 0
    outstanding: int = 0
    error: str | None = None
    prefill_done: bool = True


class PrefillHandoff:
    """The sending side. `send` may run on another thread than the loop; it holds the lock only
    for bookkeeping, never across a transport call.

    Layer-wise streaming (`expect_stream`): the sequence is still prefilling when its SendKV
    comes; the route is kept, and during the forward of its last chunk `layer_done` hands each
    finished layer (of every chunk: the earlier chunks' pages of that layer are in the pool
    already) to the transport, so the transfer overlaps the remaining layers. The handoff then
    takes its own reference on the blocks, since the engine frees its own when the sequence
    leaves it (`hold`, or a first token that ends the request); the handoff ends once every
    layer's send has ended. Transfers move the pool's slots: for a model whose layers form
    several KV groups, a slot is sent once every group's layer in it is done (`slots_done`)."""

    def __init__(
        self,
        block_manager: BlockManager,
        pool: KVPool | None,
        transport: str,
        make_sender: Callable[[str, KVPool], KVSender] | None = None,
        num_layers: int | None = None,
        slots_done: Callable[[int], int] | None = None,
    ) -> None:
        """num_layers: the pool's slots, what transfers move (default: the pool's);
        slots_done(layer): the leading slots complete once that layer is (default: layer + 1)."""
        if make_sender is None:
            from pdserve.kv_transfer import make_sender
        self.block_manager = block_manager
        self.pool = pool
        self.transport = transport  # used when a receiver does not say which it speaks
        self.num_layers = num_layers or (pool.layout.num_slots if pool is not None else 1)
        if slots_done is None and pool is not None and pool.layout.layer_kinds:
            slots_done = pool.layout.groups.slots_done_after
        self.slots_done = slots_done or (lambda layer: layer + 1)
        self._make_sender = make_sender
        self.handoffs: dict[str, Handoff] = {}
        # One sender per transport, made on first use: each decode node's receiver says which
        # it speaks (a deployment may mix cuda_ipc within a host and nccl across).
        self.senders: dict[str, KVSender] = {}
        self._refused: list[TransferDone] = []  # orders for KV not held here (nothing to free)
        # Routes of streaming prefills whose SendKV (on the handoff socket's thread) came before
        # the loop took their Prefill order: expect_stream picks them up.
        self._ahead: dict[str, Route] = {}
        self.blocks_sent = 0  # blocks whose pages handoffs that succeeded moved (since start)
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        """Handoffs holding blocks or sends (a streaming prefill still running does not count)."""
        return sum(h.state is not HandoffState.PREFILLING for h in self.handoffs.values())

    def holds(self, request_id: str) -> bool:
        return request_id in self.handoffs

    def expect_stream(self, request_id: str) -> None:
        """Loop: a prefill whose destination may come before its end (layer-wise streaming)."""
        with self._lock:
            self.handoffs[request_id] = Handoff(
                request_id,
                [[]],
                HandoffState.PREFILLING,
                prefill_done=False,
                route=self._ahead.pop(request_id, None),
            )

    def streams(self, request_id: str) -> bool:
        """Whether request_id is a streaming prefill still in the engine."""
        handoff = self.handoffs.get(request_id)
        return handoff is not None and not handoff.prefill_done

    def layer_done(self, request_id: str, tables: list[list[int]], layer: int) -> None:
        """Loop, during the forward of a streaming sequence's last chunk: layers up to `layer`
        are in `tables` (the blocks the decode side will read, a table per KV group). Sends the
        slots not sent yet, if the destination is known; otherwise they go with the rest once
        it is."""
        done = self.slots_done(layer)
        with self._lock:
            handoff = self.handoffs.get(request_id)
            if (
                handoff is None
                or handoff.route is None
                or handoff.error is not None
                or handoff.state not in (HandoffState.PREFILLING, HandoffState.SENDING)
                or done <= handoff.next_layer
            ):
                return
            if handoff.state is HandoffState.PREFILLING:
                handoff.tables = [list(t) for t in tables]
                # the engine frees its own references
                self.block_manager.share(live_blocks(handoff.tables))
                handoff.state = handoff.state.to(HandoffState.SENDING)
            layers = (handoff.next_layer, done)
            handoff.next_layer = done
            handoff.outstanding += 1
        self._start(handoff, layers)

    def hold(self, request_id: str, tables: list[list[int]]) -> None:
        """Loop: keep a prefilled sequence's blocks (a table per KV group) until its KV is sent
        (the engine's references pass to the handoff)."""
        rest = None
        tables = [list(t) for t in tables]
        with self._lock:
            handoff = self.handoffs.get(request_id)
            if handoff is None:
                self.handoffs[request_id] = Handoff(request_id, tables, HandoffState.HELD)
                return
            handoff.prefill_done = True
            if handoff.state is HandoffState.PREFILLING:  # nothing sent yet
                handoff.tables = tables
                handoff.state = handoff.state.to(HandoffState.HELD)
                if handoff.route is not None:
                    rest = self._take_rest(handoff)
            else:  # streamed: the handoff holds references of its own
                self.block_manager.free(live_blocks(tables))
                if handoff.state is HandoffState.SENDING and handoff.error is None:
                    rest = self._take_rest(handoff)
        if rest is not None:
            self._start(handoff, rest)

    def send(
        self,
        request_id: str,
        decode_node: str,
        receiver_info: dict,
        dst_blocks: list[int],
        timeout_s: float,
        skip_blocks: int = 0,
        prefilling: bool = False,
    ) -> None:
        """Any thread: start moving a held sequence's KV into a decode node's blocks, all but the
        first skip_blocks (the decode node holds those already); or, for a streaming prefill
        still running, keep the destination for its layers. prefilling: the order was given
        while the prefill runs, maybe before the loop took its Prefill order. A send that cannot
        start is reported by the next `poll` (its blocks freed there); one with nothing left to
        move ends there, successfully."""
        route = Route(decode_node, receiver_info, list(dst_blocks), timeout_s, skip_blocks)
        with self._lock:
            handoff = self.handoffs.get(request_id)
            if handoff is None and prefilling:
                self._ahead[request_id] = route
                return
            if (
                handoff is None
                or handoff.route is not None
                or handoff.state
                not in (
                    HandoffState.PREFILLING,
                    HandoffState.HELD,
                )
            ):
                self._refused.append(TransferDone(request_id, False, "no prefilled KV held here"))
                return
            handoff.route = route
            if handoff.state is HandoffState.PREFILLING:
                return  # layer_done or hold sends
            layers = self._take_rest(handoff)
        if layers is not None:
            self._start(handoff, layers)

    def _take_rest(self, handoff: Handoff) -> tuple[int, int] | None:
        """(Lock held.) Claim the layers not sent yet for one send, or None if none are left."""
        if handoff.next_layer >= self.num_layers:
            return None
        layers = (handoff.next_layer, self.num_layers)
        handoff.next_layer = self.num_layers
        handoff.outstanding += 1
        handoff.state = handoff.state.to(HandoffState.SENDING)
        return layers

    def _start(self, handoff: Handoff, layers: tuple[int, int]) -> None:
        """Hand one send (claimed under the lock) to the transport: the blocks after the ones
        the decode node holds. A send with nothing to move ends at once."""
        route = handoff.route
        transport = route.receiver_info.get("transport", self.transport)
        whole = layers == (0, self.num_layers)
        src_blocks = handoff_blocks(handoff.tables, max(route.skip_blocks, 0))
        if route.skip_blocks < 0 or len(src_blocks) != len(route.dst_blocks) or not src_blocks:
            with self._lock:
                handoff.outstanding -= 1
                if src_blocks or route.skip_blocks < 0:
                    held = len(live_blocks(handoff.tables))
                    handoff.error = handoff.error or (
                        f"send failed: {held} blocks held, {route.skip_blocks} "
                        f"skipped, {len(route.dst_blocks)} destination blocks"
                    )
            return
        try:
            with self._lock:
                sender = self._sender(transport)
            # Returns at once: a no-op for a connected receiver, a new handshake for one that
            # moved (a restarted decode node); the send waits for it on the sender's thread.
            sender.connect(route.decode_node, route.receiver_info)
            sender.send(
                KVSend(
                    handoff.request_id,
                    route.decode_node,
                    src_blocks,
                    route.dst_blocks,
                    layers=None if whole else layers,
                    timeout_s=route.timeout_s,
                )
            )
        except Exception as exc:  # a bad peer (or transport) must not take the node down
            logger.warning(
                "[%s] send to %s failed to start: %s", handoff.request_id, route.decode_node, exc
            )
            with self._lock:
                handoff.outstanding -= 1
                handoff.error = handoff.error or f"send failed: {exc}"

    def abort(self, request_id: str) -> bool:
        """Loop: the request ended. Held blocks are freed now; blocks being sent once the sends
        end. False if the handoff holds no blocks for it (a streaming prefill not started
        sending: the engine's abort frees its blocks)."""
        with self._lock:
            self._ahead.pop(request_id, None)
            handoff = self.handoffs.get(request_id)
            if handoff is None:
                return False
            if handoff.state is HandoffState.PREFILLING:
                del self.handoffs[request_id]
                return False
            if handoff.state is HandoffState.HELD:
                del self.handoffs[request_id]
                self.block_manager.free(live_blocks(handoff.tables))
            else:
                handoff.state = handoff.state.to(HandoffState.CANCELLED)
                handoff.prefill_done = True
            return True

    def reset(self) -> None:
        """Loop: drop every handoff (the coordinator moved this node's requests elsewhere)."""
        for request_id in list(self.handoffs):
            self.abort(request_id)
        with self._lock:
            self._ahead.clear()

    def poll(self) -> list[TransferDone]:
        """Loop: the handoffs that ended since the last poll (every send ended, one failed, or
        none could start), their blocks freed, for the coordinator to hear of."""
        with self._lock:
            for result in [r for sender in self.senders.values() for r in sender.poll()]:
                handoff = self.handoffs.get(result.transfer_id)
                if handoff is None:
                    continue
                handoff.outstanding -= 1
                if not result.ok:
                    handoff.error = handoff.error or result.error
            ends = []
            for handoff in list(self.handoffs.values()):
                if not self._ended(handoff):
                    continue
                del self.handoffs[handoff.request_id]
                self.block_manager.free(live_blocks(handoff.tables))
                ok = handoff.error is None and handoff.state is HandoffState.SENDING
                if ok and handoff.route is not None:
                    skip = max(handoff.route.skip_blocks, 0)
                    self.blocks_sent += len(handoff_blocks(handoff.tables, skip))
                error = handoff.error or (None if ok else "aborted")
                ends.append(TransferDone(handoff.request_id, ok, error))
            refused, self._refused = self._refused, []
            self._drop_failed_senders()
        return ends + refused

    def _ended(self, handoff: Handoff) -> bool:
        if not handoff.prefill_done or handoff.outstanding > 0:
            return False
        if handoff.state is HandoffState.CANCELLED or handoff.error is not None:
            return True
        return handoff.state is HandoffState.SENDING and handoff.next_layer >= self.num_layers

    def _drop_failed_senders(self) -> None:
        """(Lock held.) A sender whose thread died has failed its sends; the next send to that
        transport gets a fresh one."""
        for transport, sender in list(self.senders.items()):
            if sender.failed is not None:
                logger.error("KV sender (%s) failed: %s; replacing it", transport, sender.failed)
                del self.senders[transport]
                sender.close()

    def _sender(self, transport: str) -> KVSender:
        if transport not in self.senders:
            self.senders[transport] = self._make_sender(transport, self.pool)
        return self.senders[transport]

    def close(self) -> None:
        with self._lock:
            for sender in self.senders.values():
                sender.close()
            self.senders.clear()
