"""A decode node's KV handoffs: reserve blocks for a sequence whose KV will arrive, expect it,
and hand the sequence over once every page is in; free the blocks if it fails or is cancelled.
Used by the node's loop only; nothing here blocks on the network.

A handoff's states and their moves are the prefill node's too (`pdserve.cluster.handoff_state`);
its record (`Handoff`) is this side's own: what receiving needs (the sequence, the blocks reused
or loaded from the tiers, what is still awaited), where the prefill side's holds what sending
needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cluster.handoff_state import HandoffState
from pdserve.cluster.node_messages import TransferDone
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.groups import KVGroups
from pdserve.engine.kv.kv_manager import KVCacheManager, handoff_blocks
from pdserve.engine.kv.tiers import KVTiers
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer.base import KVReceiver, TransferResult, TransportFailed

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Handoff:
    """The receiving side's handoff of one request: EXPECTING, maybe ARRIVED (early admission)."""

    request_id: str
    state: HandoffState
    # The sequence that runs once its KV is in; its block tables (a table per KV group) hold
    # one reference on each block, owned by the handoff until then.
    seq: Sequence
    # Leading blocks of `blocks` found in the prefix cache or the KV tiers below it, not sent.
    num_reused: int = 0
    first_token_pending: bool = False  # early admission: the first token has not come yet
    pages_pending: bool = False  # the sender's pages are still awaited
    # Blocks after the pool's cached prefix being loaded from the tiers below it (0: none or
    # done); a block that failed to load, and those after it, are computed here instead.
    loading_below: int = 0
    computed_below: int | None = None  # tokens holding KV once the tiers' load ended


class DecodeHandoff:
    """The receiving side; used by the loop only."""

    def __init__(
        self,
        receiver: KVReceiver,
        block_manager: BlockManager,
        on_end: Callable[[TransferResult], None] | None = None,
        tiers: KVTiers | None = None,
        kv: KVCacheManager | None = None,
    ) -> None:
        """on_end: called with the receiver's result of each expected transfer that ended,
        landed or failed (the node's traces). tiers: the KV tiers under the pool, where a
        reused prefix is looked up past the pool's own (their loads end in the engine's
        step). kv: the engine's KV manager, which knows the model's KV groups (default: one)."""
        self.receiver = receiver
        self.block_manager = block_manager
        self.kv = kv or KVCacheManager(block_manager, KVGroups.uniform(1))
        self.tiers = tiers
        self.on_end = on_end
        self.handoffs: dict[str, Handoff] = {}
        # Reservations whose every block was found cached: nothing to receive, in at the next
        # poll.
        self._complete: list[str] = []
        # Handoffs whose load from the tiers ended since the last poll.
        self._settled: list[str] = []
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
        bm, kv = self.block_manager, self.kv
        computed = seq.num_computed_tokens
        # The token after the computed ones stays uncovered (with early admission, the prompt's
        # last), so only full blocks of computed tokens can match; a partial last block is
        # always sent.
        matched = seq.token_ids[: computed + 1]
        kv.free(seq)
        if reuse_prefix:
            probe = Sequence(seq.request_id, matched, seq.params)
            kv.allocate_prefix(probe)
            seq.block_tables = probe.block_tables
        num_cached = len(seq.block_table)
        found = self.tiers.find(kv, seq, computed + 1) if reuse_prefix and self.tiers else None
        hits = found.hits if found is not None else []
        if hits and not kv.allocate_load(seq, found.prefix):
            self.tiers.release(hits)
            kv.free(seq)
            return None
        num_reused = found.prefix.num_blocks if hits else num_cached
        if not kv.allocate_arriving(seq, computed, num_reused * bm.block_size):
            if hits:
                self.tiers.release(hits)
            kv.free(seq)
            return None
        dst = handoff_blocks(seq.block_tables, num_reused)
        if dst:
            try:
                self.receiver.expect(seq.request_id, list(dst), timeout_s=timeout_s)
            except Exception:
                if hits:
                    self.tiers.release(hits)
                kv.free(seq)
                raise
        else:
            self._complete.append(seq.request_id)
        seq.num_cached_tokens = num_reused * bm.block_size
        self.blocks_reused += num_reused
        handoff = Handoff(
            seq.request_id,
            HandoffState.EXPECTING,
            seq,
            num_reused=num_reused,
            first_token_pending=first_token_pending,
            pages_pending=bool(dst),
            loading_below=len(hits),
        )
        self.handoffs[seq.request_id] = handoff
        if found is not None:
            self.tiers.count_lookup(found)
        if hits:
            prefix = found.prefix
            self.tiers.load(
                prefix.blocks,
                hits,
                lambda n: self._loaded_below(
                    handoff, kv.cache_loaded(seq, prefix, n) * bm.block_size
                ),
            )
        return list(dst)

    def _loaded_below(self, handoff: Handoff, computed: int) -> None:
        """The tiers' load for a handoff ended, its KV complete up to `computed` tokens (in
        every group: a block that failed, and whatever a window after it reads, is computed
        here)."""
        handoff.loading_below = 0
        if computed < handoff.num_reused * self.block_manager.block_size:
            handoff.computed_below = computed
        self._settled.append(handoff.request_id)

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
        """The request ended. The blocks are freed once nothing writes into them: now when no
        sender was ever asked for this KV (kv_unsent) or all of it is in; otherwise the
        receiver stops the transfer, and the blocks are freed at the poll that sees it end (and
        any load from the tiers below the pool end). False if nothing is reserved for it."""
        handoff = self.handoffs.get(request_id)
        if handoff is None:
            return False
        if (
            handoff.pages_pending
            and self.receiver.failed is None
            and handoff.state is HandoffState.EXPECTING
        ):
            self.receiver.cancel(request_id, "aborted")
        if kv_unsent:
            handoff.pages_pending = False
        handoff.state = handoff.state.to(HandoffState.CANCELLED)
        self._settle(handoff, [])
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
        for request_id in self._complete + self._settled:
            handoff = self.handoffs.get(request_id)
            if handoff is not None:
                self._settle(handoff, arrived)
        self._complete.clear()
        self._settled.clear()
        for result in self.receiver.poll():
            handoff = self.handoffs.get(result.transfer_id)
            if handoff is None or not handoff.pages_pending:
                continue
            handoff.pages_pending = False
            if handoff.state is HandoffState.EXPECTING:
                if self.on_end is not None:
                    self.on_end(result)
                if result.ok:
                    self.blocks_received += len(
                        handoff_blocks(handoff.seq.block_tables, handoff.num_reused)
                    )
                else:
                    logger.warning("[%s] KV arrival failed: %s", result.transfer_id, result.error)
                    failed.append(TransferDone(result.transfer_id, False, result.error))
                    handoff.state = handoff.state.to(HandoffState.CANCELLED)
            self._settle(handoff, arrived)
        return arrived, failed

    def _settle(self, handoff: Handoff, arrived: list[Sequence]) -> None:
        """Once nothing writes into a handoff's blocks any more (no pages awaited, no load from
        the tiers in flight): a cancelled one's blocks are freed, an expecting one lands."""
        if handoff.pages_pending or handoff.loading_below:
            return
        if handoff.state is HandoffState.CANCELLED:
            del self.handoffs[handoff.request_id]
            self.kv.free(handoff.seq)
        elif handoff.state is HandoffState.EXPECTING:
            del self.handoffs[handoff.request_id]
            self._land(handoff, arrived)

    def _land(self, handoff: Handoff, arrived: list[Sequence]) -> None:
        """Every page of a handoff is in: its full blocks enter the prefix cache, and its
        sequence is ready to run (or, admitted early, waits for its first token)."""
        seq = handoff.seq
        if handoff.computed_below is not None:  # from there on, computed here
            self.kv.trim(seq, handoff.computed_below)  # its tables hold what its KV holds
            seq.num_computed_tokens = seq.num_cached_tokens = handoff.computed_below
        self.kv.cache_full_blocks(seq)
        if handoff.first_token_pending:  # runs when its first token comes
            handoff.state = handoff.state.to(HandoffState.ARRIVED)
            self.handoffs[handoff.request_id] = handoff
        else:
            arrived.append(seq)
