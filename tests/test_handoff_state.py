"""A KV handoff's state machine alone: the prefill side's handoff goes PREFILLING or HELD to
SENDING, the decode side's EXPECTING to ARRIVED, either may end CANCELLED, and no other move is
made, nor one from one side's states into the other's."""

from __future__ import annotations

import pytest

from pdserve.cluster.handoff_state import MOVES, HandoffState, HandoffStateError

S = HandoffState
SENDER = {S.PREFILLING, S.HELD, S.SENDING, S.CANCELLED}
RECEIVER = {S.EXPECTING, S.ARRIVED, S.CANCELLED}
ALLOWED = {
    (S.PREFILLING, S.HELD),  # the prefill ended before its destination came
    (S.PREFILLING, S.SENDING),  # streamed: its first layers left during the prefill
    (S.HELD, S.SENDING),
    (S.SENDING, S.CANCELLED),
    (S.EXPECTING, S.ARRIVED),  # early admission: every layer in, the first token awaited
    (S.EXPECTING, S.CANCELLED),
    (S.ARRIVED, S.CANCELLED),
}


def reachable(start: HandoffState) -> set[HandoffState]:
    seen, todo = {start}, [start]
    while todo:
        for state in MOVES[todo.pop()] - seen:
            seen.add(state)
            todo.append(state)
    return seen


def test_the_allowed_moves_are_these_and_staying_is_no_move():
    for a in HandoffState:
        for b in HandoffState:
            if (a, b) in ALLOWED or a is b:
                assert a.to(b) is b
            else:
                with pytest.raises(HandoffStateError, match=f"{a.value} cannot become {b.value}"):
                    a.to(b)


def test_each_side_stays_within_its_own_states_and_cancelled_is_the_last():
    assert set(MOVES) == set(HandoffState)
    assert reachable(S.PREFILLING) | reachable(S.HELD) == SENDER
    assert reachable(S.EXPECTING) == RECEIVER
    assert MOVES[S.CANCELLED] == frozenset()
