"""Which rank of a prefill node sends which KV heads to which rank of a decode node, when both
are tensor-parallel groups (of the same size or not): each rank's pool holds a range of the
model's KV heads, and every head a decode rank holds must come from exactly one prefill rank
that holds it. Pure: both sides' head ranges in, routes out.

Rank i sends to rank i where it holds what rank i needs (same sizes: rank i to rank i, whole
pages); a head held by several prefill ranks (replicated, fewer KV heads than ranks) is taken
from them in turn, so the sends spread over the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HeadRange = tuple[int, int]  # [start, stop) of the model's KV heads


@dataclass(frozen=True, slots=True)
class HeadRoute:
    src_rank: int
    dst_rank: int
    src_heads: HeadRange  # in the source rank's pool (its own head indexes)
    dst_heads: HeadRange  # in the destination rank's pool


def route_heads(src: Sequence[HeadRange], dst: Sequence[HeadRange]) -> list[HeadRoute]:
    """Routes that fill every destination rank's heads once, in destination rank order."""
    routes: list[HeadRoute] = []
    for d, (d0, d1) in enumerate(dst):
        pieces: list[list[int]] = []  # [source rank, first head, last head + 1]
        for head in range(d0, d1):
            holders = [s for s, (s0, s1) in enumerate(src) if s0 <= head < s1]
            if not holders:
                raise ValueError(
                    f"KV head {head} of destination rank {d} is held by no source rank"
                )
            s = d if d in holders else holders[d % len(holders)]
            if pieces and pieces[-1][0] == s and pieces[-1][2] == head:
                pieces[-1][2] = head + 1
            else:
                pieces.append([s, head, head + 1])
        for s, h0, h1 in pieces:
            s0 = src[s][0]
            routes.append(HeadRoute(s, d, (h0 - s0, h1 - s0), (h0 - d0, h1 - d0)))
    return routes
