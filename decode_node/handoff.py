"""A decode node's KV handoffs: reserve blocks for a sequence whose KV will arrive, expect it,
and hand the sequence over once every page is in; free the blocks if it fails or is cancelled.
Used by the node's loop only; nothing here blocks on the network.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.node_messages import TransferDone
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer.base import KVReceiver, TransferResult, TransportFailed

logger = logging.getLogger(__name__)


class HandoffState(enum.Enum):
    EXPECTING = "expecting"  # blocks reserved, pages awaited
    # early admission: every layer is in, the first token (StartDecode) is awaited
    ARRIVED = "arrived"
    # Ended by an abort while a sender may still write into the blocks: freed once it is done.
    CANCELLED = "cancelled"


@dataclass(slots=True)
class Handoff:
    request_id: str
    blocks: list[int]  # one reference on each, owned by the handoff
    state: HandoffState
    seq: Sequence  # the sequence that runs once its KV is in
    num_reused: int = 0  # leading blocks of `blocks` found in the prefix cache, not sent
    first_token_pending: bool = False  # early admission: the first token has not come yet


class DecodeHandoff:
    """The receiving side; used by the loop only."""

    def __init__(
        self,
        receiver: KVReceiver,
        block_manager: BlockManager,
        on_end: Callable[[TransferResult], None] | None = None,
    ) -> None:
        """on_end: called with the receiver's result of each expected transfer that ended,
        landed or failed (the node's traces)."""
        self.receiver = receiver
        self.block_manager = block_manager
        self.on_end = on_end
        self.handoffs: dict[str, Handoff] = {}
        # Reservations whose every block was found cached: nothing to receive, in at the next
        # poll.
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
        self,
        seq: Sequence,
        timeout_s: float,
        reuse_prefix: bool = False,
        first_token_pending: bool = False,
    ) -> list[int] | None:
        """Blocks for the KV of seq's computed tokens, expected from a sender within timeout_s;
        None (nothing held) when the pool has no room. Raises TransportFailed when the receiver
        is broken.

        reuse_prefix: the leading full blocks already in the prefix cache are taken (referenced,
        so never evicted while this handoff holds them) and only the blocks after them are
        returned and expected: the sender skips `len(seq.block_table) - len(returned)` blocks.

        first_token_pending (early admission): seq holds only its prompt, and it runs once
        every layer is in and `start` has given it its first token, in either order (that
        token's slot is allocated by its first decode step, as for any sequence)."""
        if self.receiver.failed is not None:
            raise TransportFailed(self.receiver.failed)
        bm = self.block_manager
        computed = seq.num_computed_tokens
        # The token after the computed ones stays uncovered (with early admission, the prompt's
        # last), so only full blocks of computed tokens can match; a partial last block is
        # always sent.
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
            seq.request_id,
            blocks,
            HandoffState.EXPECTING,
            seq,
            num_reused=num_reused,
            first_token_pending=first_token_pending,
        )
        return list(dst)

    def start(self, request_id: str, token_id: int) -> Sequence | None:
        """An early-admitted sequence's first token (StartDecode): the sequence, ready to run,
        if its KV is all in already (else `poll` hands it out once it is); None otherwise."""
        handoff = self.handoffs.get(request_id)
        if handoff is None or not handoff.first_token_pending:
            return None  # cancelled, refused, or a duplicate
        handoff.first_token_pending = False
        handoff.seq.token_ids.append(token_id)
        if handoff.state is not HandoffState.ARRIVED:
            return None
        del self.handoffs[request_id]
        return handoff.seq

    def cancel(self, request_id: str, kv_unsent: bool = False) -> bool:
        """The request ended. With kv_unsent (no sender was ever asked for this KV), or when
        nothing was to be received or all of it is in, the blocks are freed now. Otherwise a
        sender may be writing: the receiver stops the transfer and the blocks are freed at the
        poll that sees it end, once nothing writes into them. False if nothing is reserved for
        it."""
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
        if handoff.state is HandoffState.ARRIVED or (
            kv_unsent and handoff.state is HandoffState.EXPECTING
        ):  # nothing writes into the blocks any more
            del self.handoffs[request_id]
            self.block_manager.free(handoff.blocks)
        else:
            handoff.state = HandoffState.CANCELLED
        return True

    def reset(self) -> None:
        """Drop every handoff (the coordinator moved this node's requests elsewhere)."""
        for request_id in list(self.handoffs):
            self.cancel(request_id)

    def poll(self) -> tuple[list[Sequence], list[TransferDone]]:
        """Sequences whose KV has fully arrived (ready to run, their full blocks entered into
        the prefix cache), and failed handoffs to report; the blocks of failed and cancelled
        ones are freed."""
        arrived: list[Sequence] = []
        failed: list[TransferDone] = []
        for request_id in self._complete:
            self._land(self.handoffs.pop(request_id), arrived)
        self._complete.clear()
        for result in self.receiver.poll():
            handoff = self.handoffs.pop(result.transfer_id, None)
            if handoff is None:
                continue
            if self.on_end is not None and handoff.state is HandoffState.EXPECTING:
                self.on_end(result)
            if result.ok and handoff.state is HandoffState.EXPECTING:
                self.blocks_received += len(handoff.blocks) - handoff.num_reused
                self._land(handoff, arrived)
                continue
            self.block_manager.free(handoff.blocks)
            if not result.ok and handoff.state is HandoffState.EXPECTING:
                logger.warning("[%s] KV arrival failed: %s", result.transfer_id, result.error)
                failed.append(TransferDone(result.transfer_id, False, result.error))
        return arrived, failed

    def _land(self, handoff: Handoff, arrived: list[Sequence]) -> None:
        """Every page of a handoff is in: its full blocks enter the prefix cache, and its
        sequence is ready to run (or, admitted early, waits for its first token)."""
        seq = handoff.seq
        self.block_manager.cache_full_blocks(
            seq.block_table, seq.token_ids, seq.num_computed_tokens
        )
        if handoff.first_token_pending:  # runs when its first token comes
            handoff.state = HandoffState.ARRIVED
            self.handoffs[handoff.request_id] = handoff
        else:
            arrived.append(seq)
