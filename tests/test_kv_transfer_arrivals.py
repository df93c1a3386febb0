"""The receiver's bookkeeping alone (no sockets): a transfer completes exactly when its last
layer arrives, whatever the order of its sends; nothing lands without an expect()."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.arrivals import Arrivals, Unit, UnitState

pytestmark = pytest.mark.timeout(60)

PEER = b"prefill-0"


def deliver(arrivals: Arrivals, unit: Unit) -> str | None:
    unit.pages = unit.total_pages
    return arrivals.close_unit(unit)


@st.composite
def layer_splits(draw) -> tuple[int, list[tuple[int, int]]]:
    num_layers = draw(st.integers(1, 12))
    inner = st.sets(st.integers(1, num_layers - 1)) if num_layers > 1 else st.just(set())
    cuts = sorted(draw(inner))
    bounds = [0, *cuts, num_layers]
    ranges = list(zip(bounds, bounds[1:]))
    return num_layers, draw(st.permutations(ranges))


@settings(max_examples=60, deadline=None)
@given(layer_splits(), st.booleans())
def test_transfer_completes_exactly_when_its_last_layer_range_arrives(split, early) -> None:
    num_layers, ranges = split
    arrivals = Arrivals(num_layers, num_blocks=8)
    dst = [5, 1, 7]
    if not early:
        arrivals.expect("t", dst, None, timeout_s=10.0, now=0.0)
    units = []
    for i, rng in enumerate(ranges):
        unit = arrivals.open_unit(PEER, i, "t", list(reversed(dst)), rng, 10.0, now=0.0)
        assert isinstance(unit, Unit)
        units.append(unit)
    if early:  # sends came first: they wait, then the expect() admits them
        assert all(u.state is UnitState.WAITING for u in units)
        exp = arrivals.expect("t", dst, None, timeout_s=10.0, now=0.0)
        assert all(arrivals.admit(u, exp) is None for u in units)
    for i, unit in enumerate(units):
        assert not arrivals.expected["t"].complete
        assert deliver(arrivals, unit) is None
        assert arrivals.expected["t"].complete == (i == len(units) - 1)
    assert not arrivals.units


def test_a_send_that_does_not_match_the_expected_blocks_or_layers_is_refused() -> None:
    arrivals = Arrivals(num_layers=4, num_blocks=8)
    arrivals.expect("t", [1, 2], (0, 2), timeout_s=10.0, now=0.0)
    assert "differ" in arrivals.open_unit(PEER, 1, "t", [1, 3], (0, 2), 10.0, now=0.0)
    assert "outside" in arrivals.open_unit(PEER, 2, "t", [1, 2], (1, 3), 10.0, now=0.0)
    unit = arrivals.open_unit(PEER, 3, "t", [2, 1], (0, 1), 10.0, now=0.0)
    assert deliver(arrivals, unit) is None
    assert "already arrived" in arrivals.open_unit(PEER, 4, "t", [1, 2], (0, 2), 10.0, now=0.0)


def test_deadlines_expire_expectations_and_waiting_sends_and_finished_ids_are_refused() -> None:
    arrivals = Arrivals(num_layers=2, num_blocks=8, remember_s=100.0)
    arrivals.expect("t", [0], None, timeout_s=1.0, now=0.0)
    waiting = arrivals.open_unit(PEER, 1, "u", [3], (0, 2), 2.0, now=0.0)
    assert arrivals.expired(0.5) == ([], [])
    exps, units = arrivals.expired(2.5)
    assert [e.transfer_id for e in exps] == ["t"] and units == [waiting]
    arrivals.finish("t", now=2.5)
    assert "already finished" in arrivals.open_unit(PEER, 2, "t", [0], (0, 2), 1.0, now=3.0)
    arrivals.expired(200.0)  # long after: the id may be used again
    assert isinstance(arrivals.open_unit(PEER, 3, "t", [0], (0, 2), 1.0, now=200.0), Unit)
