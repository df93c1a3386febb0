"""A node's KV handoffs, one object per side: which blocks each handoff holds, in which state,
and the transport calls that move them. The node's loop asks and polls; nothing here blocks on
the network, so the step loop never waits on a peer.

Prefill side (`PrefillHandoff`): hold a prefilled sequence's blocks, send them when the
coordinator says where (from the loop or the handoff socket's thread), free them when the send
ends or the request is aborted. Decode side (`DecodeHandoff`): reserve blocks for a sequence
whose KV will arrive, expect it, and hand the sequence over once every page is in; free the
blocks if it fails or is cancelled. Blocks are freed only by the loop's calls (hold, abort,
poll), never by another thread: the block manager is the loop's.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.kv_cache import KVPool
from engine.sequence import Sequence
from kv_transfer.base import KVReceiver, KVSender, TransportFailed

logger = logging.getLogger(__name__)


class HandoffState(enum.Enum):
    HELD = "held"  # prefill: KV computed and kept, waiting to be sent
    SENDING = "sending"  # prefill: pages on their way
    EXPECTING = "expecting"  # decode: blocks reserved, pages awaited
    # Ended by an abort while the transport may still touch the blocks: freed once it is done.
    CANCELLED = "cancelled"


@dataclass(slots=True)
class Handoff:
    request_id: str
    blocks: list[int]
    state: HandoffState
    seq: Sequence | None = None  # decode side: the sequence that runs once its KV is in
    # Decode side: leading blocks of `blocks` found in the prefix cache, not sent.
    num_reused: int = 0


@dataclass(slots=True)
class HandoffEnd:
    """A handoff that ended, for the node to report (TransferDone)."""

    request_id: str
    ok: bool
    error: str | None = None


class PrefillHandoff:
    """The sending side. `send` may run on another thread than the loop; it holds the lock only
    for bookkeeping, never across a transport call."""

    def __init__(
        self,
        block_manager: BlockManager,
        pool: KVPool,
        transport: str,
        make_sender: Callable[[str, KVPool], KVSender] | None = None,
    ) -> None:
        if make_sender is None:
            from kv_transfer import make_sender
        self.block_manager = block_manager
        self.pool = pool
        self.transport = transport  # used when a receiver does not say which it speaks
        self._make_sender = make_sender
        self.handoffs: dict[str, Handoff] = {}
        # One sender per transport, made on first use: each decode node's receiver says which
        # it speaks (a deployment may mix cuda_ipc within a host and nccl across).
        self.senders: dict[str, KVSender] = {}
        # Sends that ended without the transport: could not start, or had nothing to move.
        self._ended_early: list[HandoffEnd] = []
        self._refused: list[HandoffEnd] = []  # orders for KV not held here (nothing to free)
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        return len(self.handoffs)

    def holds(self, request_id: str) -> bool:
        return request_id in self.handoffs

    def hold(self, request_id: str, blocks: list[int]) -> None:
        """Loop: keep a prefilled sequence's blocks until its KV is sent."""
        with self._lock:
            self.handoffs[request_id] = Handoff(request_id, blocks, HandoffState.HELD)

    def send(
        self,
        request_id: str,
        decode_node: str,
        receiver_info: dict,
        dst_blocks: list[int],
        timeout_s: float,
        skip_blocks: int = 0,
    ) -> None:
        """Any thread: start moving a held sequence's KV into a decode node's blocks, all but the
        first skip_blocks (the decode node holds those already). A send that cannot start is
        reported by the next `poll` (its blocks freed there); one with nothing left to move
        ends there at once, successfully."""
        transport = receiver_info.get("transport", self.transport)
        with self._lock:
            handoff = self.handoffs.get(request_id)
            if handoff is None or handoff.state is not HandoffState.HELD:
                self._refused.append(HandoffEnd(request_id, False, "no prefilled KV held here"))
                return
            handoff.state = HandoffState.SENDING
            src_blocks = handoff.blocks[skip_blocks:]
            if skip_blocks < 0 or len(src_blocks) != len(dst_blocks):
                self._fail_start(
                    handoff,
                    f"send failed: {len(handoff.blocks)} blocks held, {skip_blocks} skipped, "
                    f"{len(dst_blocks)} destination blocks",
                )
                return
            if not src_blocks:  # every block is cached on the decode node: nothing to move
                self._ended_early.append(HandoffEnd(request_id, True))
                return
            try:
                sender = self._sender(transport)
            except Exception as exc:  # e.g. a transport this host cannot load
                self._fail_start(handoff, f"send failed: {exc}")
                return
        try:
            # Returns at once: a no-op for a connected receiver, a new handshake for one that
            # moved (a restarted decode node); the send waits for it on the sender's thread.
            sender.connect(decode_node, receiver_info)
            sender.send(request_id, decode_node, src_blocks, dst_blocks, timeout_s=timeout_s)
        except Exception as exc:  # a bad peer must not take the node down
            logger.warning("[%s] send to %s failed to start: %s", request_id, decode_node, exc)
            with self._lock:
                self._fail_start(handoff, f"send failed: {exc}")

    def _fail_start(self, handoff: Handoff, error: str) -> None:
        """(Lock held.) The send never started: the loop frees the blocks at its next poll."""
        handoff.state = HandoffState.CANCELLED
        self._ended_early.append(HandoffEnd(handoff.request_id, False, error))

    def abort(self, request_id: str) -> bool:
        """Loop: the request ended. Held blocks are freed now; blocks being sent once the send
        ends. False if nothing is held for it."""
        with self._lock:
            handoff = self.handoffs.get(request_id)
            if handoff is None:
                return False
            if handoff.state is HandoffState.HELD:
                del self.handoffs[request_id]
                self.block_manager.free(handoff.blocks)
            else:
                handoff.state = HandoffState.CANCELLED
            return True

    def reset(self) -> None:
        """Loop: drop every handoff (the coordinator moved this node's requests elsewhere)."""
        for request_id in list(self.handoffs):
            self.abort(request_id)

    def poll(self) -> list[HandoffEnd]:
        """Loop: the handoffs that ended since the last poll (sent, failed, or never started),
        their blocks freed, for the coordinator to hear of."""
        with self._lock:
            results = [r for sender in self.senders.values() for r in sender.poll()]
            ends, self._ended_early = self._ended_early, []
            ends += [HandoffEnd(r.transfer_id, r.ok, r.error) for r in results]
            for end in ends:
                handoff = self.handoffs.pop(end.request_id, None)
                if handoff is not None:
                    self.block_manager.free(handoff.blocks)
            refused, self._refused = self._refused, []
            self._drop_failed_senders()
        return ends + refused

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


class DecodeHandoff:
    """The receiving side; used by the loop only."""

    def __init__(self, receiver: KVReceiver, block_manager: BlockManager) -> None:
        self.receiver = receiver
        self.block_manager = block_manager
        self.handoffs: dict[str, Handoff] = {}
        # Reservations whose every block was found cached: nothing to receive, ready at the
        # next poll.
        self._complete: list[str] = []
        self.blocks_received = 0  # blocks whose pages arrived here, since the node started
        self.blocks_reused = 0  # blocks of admitted prompts found already cached here

    @property
    def num_pending(self) -> int:
        return len(self.handoffs)

    @property
    def failed(self) -> str | None:
        """Why this node can no longer receive KV (its receiver's thread died), or None."""
        return self.receiver.failed

    def holds(self, request_id: str) -> bool:
        return request_id in self.handoffs

    def reserve(
        self, seq: Sequence, timeout_s: float, reuse_prefix: bool = False
    ) -> list[int] | None:
        """Blocks for the KV of seq's computed tokens, expected from a sender within timeout_s;
        None (nothing held) when the pool has no room. With reuse_prefix, the leading full
        blocks already in the prefix cache are taken (referenced, so never evicted while this
        handoff holds them) and only the blocks after them are returned and expected: the
        sender skips `len(seq.block_table) - len(returned)` blocks. Raises TransportFailed when
        the receiver is broken."""
        if self.receiver.failed is not None:
            raise TransportFailed(self.receiver.failed)
        bm = self.block_manager
        computed = seq.num_computed_tokens
        # The token after the computed ones stays uncovered, so only full blocks of computed
        # tokens can match; a partial last block is always sent.
        blocks = bm.allocate_prefix(seq.token_ids[: computed + 1]) if reuse_prefix else []
        num_reused = len(blocks)
        if not bm.allocate_slots(blocks, computed, num_reused * bm.block_size):
            bm.free(blocks)
            return None
        dst = blocks[num_reused:]
        if dst:
            try:
                self.receiver.expect(seq.request_id, list(dst), timeout_s=timeout_s)
            except Exception:
                bm.free(blocks)
                raise
        else:
            self._complete.append(seq.request_id)
        seq.block_table = blocks
        seq.num_cached_tokens = num_reused * bm.block_size
        self.blocks_reused += num_reused
        self.handoffs[seq.request_id] = Handoff(
            seq.request_id, blocks, HandoffState.EXPECTING, seq, num_reused
        )
        return list(dst)

    def cancel(self, request_id: str, kv_unsent: bool = False) -> bool:
        """The request ended. With kv_unsent (no sender was ever asked for this KV), or when
        nothing was to be received, the blocks are freed now. Otherwise a sender may be
        writing: the receiver stops the transfer and the blocks are freed at the poll that sees
        it end, once nothing writes into them. False if nothing is reserved for it."""
        handoff = self.handoffs.get(request_id)
        if handoff is None:
            return False
        if request_id in self._complete:
            self._complete.remove(request_id)
            del self.handoffs[request_id]
            self.block_manager.free(handoff.blocks)
            return True
        if self.receiver.failed is None and handoff.state is HandoffState.EXPECTING:
            self.receiver.cancel(request_id, "aborted")
        if kv_unsent and handoff.state is HandoffState.EXPECTING:
            del self.handoffs[request_id]
            self.block_manager.free(handoff.blocks)
        else:
            handoff.state = HandoffState.CANCELLED
        return True

    def reset(self) -> None:
        """Drop every handoff (the coordinator moved this node's requests elsewhere)."""
        for request_id in list(self.handoffs):
            self.cancel(request_id)

    def poll(self) -> tuple[list[Sequence], list[HandoffEnd]]:
        """Sequences whose KV has fully arrived (ready to run, their full blocks entered into
        the prefix cache), and failed handoffs to report; the blocks of failed and cancelled
        ones are freed."""
        arrived: list[Sequence] = []
        failed: list[HandoffEnd] = []
        for request_id in self._complete:
            arrived.append(self._arrive(self.handoffs.pop(request_id)))
        self._complete.clear()
        for result in self.receiver.poll():
            handoff = self.handoffs.pop(result.transfer_id, None)
            if handoff is None:
                continue
            if result.ok and handoff.state is HandoffState.EXPECTING:
                self.blocks_received += len(handoff.blocks) - handoff.num_reused
                arrived.append(self._arrive(handoff))
                continue
            self.block_manager.free(handoff.blocks)
            if not result.ok and handoff.state is HandoffState.EXPECTING:
                logger.warning("[%s] KV arrival failed: %s", result.transfer_id, result.error)
                failed.append(HandoffEnd(result.transfer_id, False, result.error))
        return arrived, failed

    def _arrive(self, handoff: Handoff) -> Sequence:
        seq = handoff.seq
        self.block_manager.cache_full_blocks(
            seq.block_table, seq.token_ids, seq.num_computed_tokens
        )
        return seq
