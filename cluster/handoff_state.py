"""The states of a KV handoff on either node, and the moves between them, in one place. The
prefill node's handoff starts PREFILLING (layer-wise streaming) or HELD and goes on to SENDING; the
decode node's starts EXPECTING and may wait ARRIVED for its first token; either ends CANCELLED when
aborted while a transport may still touch its blocks. A handoff that ends leaves its node's table:
that is no state."""

from __future__ import annotations

import enum


class HandoffStateError(RuntimeError):
    """A handoff was asked to move where its state machine does not go: a bug in its node."""


class HandoffState(enum.Enum):
    # The sending side (prefill node). PREFILLING: layer-wise streaming, the prompt is still
    # prefilling in the engine (which owns its blocks); the destination may come before it ends.
    PREFILLING = "prefilling"
    HELD = "held"  # KV computed and kept, waiting to be sent
    SENDING = "sending"  # pages on their way
    # The receiving side (decode node).
    EXPECTING = "expecting"  # blocks reserved, pages awaited
    ARRIVED = "arrived"  # early admission: every layer is in, the first token is awaited
    # Either side: ended by an abort while a transport may still read or write the blocks; they
    # are freed once it is done.
    CANCELLED = "cancelled"

    def to(self, state: HandoffState) -> HandoffState:
        """`state`, if a handoff in this one may move there (staying is no move); otherwise
        HandoffStateError."""
        if state is not self and state not in MOVES[self]:
            raise HandoffStateError(f"a handoff {self.value} cannot become {state.value}")
        return state


MOVES: dict[HandoffState, frozenset[HandoffState]] = {
    HandoffState.PREFILLING: frozenset({HandoffState.HELD, HandoffState.SENDING}),
    HandoffState.HELD: frozenset({HandoffState.SENDING}),
    HandoffState.SENDING: frozenset({HandoffState.CANCELLED}),
    HandoffState.EXPECTING: frozenset({HandoffState.ARRIVED, HandoffState.CANCELLED}),
    HandoffState.ARRIVED: frozenset({HandoffState.CANCELLED}),
    HandoffState.CANCELLED: frozenset(),
}
