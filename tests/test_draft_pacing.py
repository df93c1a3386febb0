"""A speculating sequence's draft limit (`DraftPacing`): its acceptance rate counts only the
drafts a step judged, the limit follows that rate, and a sequence whose drafts never agree pauses
with probes whose waits double."""

from __future__ import annotations

import random

from pdserve.engine.spec_decode.pacing import (
    ADAPT_AFTER,
    MAX_PROBE_INTERVAL,
    PROBE_EVERY,
    DraftPacing,
)


def paced(steps: list[tuple[int, int]]) -> DraftPacing:
    """A pacing after steps of (drafts verified, drafts kept), a token each plus the kept."""
    pacing, length = DraftPacing(), 0
    for drafts, kept in steps:
        length += kept + 1
        pacing.record(drafts, kept, length)
    return pacing


def test_k_drafts_until_enough_were_verified():
    assert paced([]).limit(4, 0) == 4
    assert paced([(4, 0)]).limit(4, 1) == 4  # 4 verified: too few to judge
    assert paced([(4, 4), (4, 4), (4, 4)]).limit(4, 15) == 4  # none rejected


def test_the_rate_counts_only_the_drafts_a_step_judged():
    # Two steps of 4 drafts, 2 kept then a rejection each: 4 kept of 6 judged, not of 8 proposed.
    pacing = paced([(4, 2), (4, 2)])
    assert pacing.rate == 4 / 6
    assert pacing.limit(4, 6) == 3  # 2 in a row on average, and one more
    assert paced([(4, 1), (4, 1)]).limit(4, 4) == 2  # 1 in a row
    assert paced([(4, 0), (4, 1), (4, 0)]).limit(4, 4) == 1  # 1 of 4: 0.33 in a row
    assert paced([(4, 3), (4, 3), (4, 4)]).limit(4, 13) == 4  # 10 of 12: 5 in a row, capped


def test_a_sequence_whose_drafts_fail_probes_with_doubling_waits():
    pacing = paced([(4, 0), (4, 0)])  # 8 verified, none kept: paused
    assert pacing.paused and pacing.limit(4, 2) == 0
    length, probes = 2, []
    while length < 1000:
        if pacing.limit(4, length):
            probes.append(length)
            length += 1
            pacing.record(1, 0, length)
        else:
            length += 1
    waits = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 2 + PROBE_EVERY
    assert waits[:3] == [2 * PROBE_EVERY + 1, 4 * PROBE_EVERY + 1, 8 * PROBE_EVERY + 1]
    assert max(waits) == MAX_PROBE_INTERVAL + 1 and len(probes) < 25  # not every 8 steps


def test_a_kept_probe_brings_the_wait_back_and_enough_of_them_end_the_pause():
    pacing = paced([(4, 0), (4, 0)])
    length = 2
    for _ in range(12):  # failed probes: the wait grows to its most
        length = pacing.probe_at + 1
        pacing.record(1, 0, length)
    assert pacing.probe_interval == MAX_PROBE_INTERVAL
    length = pacing.probe_at + 2
    pacing.record(1, 1, length)  # kept: 1 of 15 judged, still paused, the wait restarted
    assert pacing.paused and pacing.probe_at == length + PROBE_EVERY
    length = pacing.probe_at + 2
    pacing.record(1, 1, length)  # 2 of 16: over the floor, proposing again
    assert not pacing.paused and pacing.limit(4, length) == 1
    assert pacing.probe_interval == PROBE_EVERY


def test_the_limit_never_exceeds_k_and_never_falls_below_zero():
    rng = random.Random(3)
    for _ in range(200):
        pacing, length = DraftPacing(), 0
        p = rng.random()
        for _ in range(60):
            k = rng.randrange(1, 7)
            limit = pacing.limit(k, length)
            assert 0 <= limit <= k
            if pacing.verified < ADAPT_AFTER:
                assert limit == k
            kept = 0
            while kept < limit and rng.random() < p:
                kept += 1
            length += kept + 1
            if limit:
                pacing.record(limit, kept, length)
