"""Where a CPU engine's math runs: the cores its process is bound to and the number of intra-op
(OpenMP) threads. Idle OpenMP threads spin, so processes sharing cores slow each other down many
times over; nodes started together on one host get disjoint shares of its cores instead.

The decisions (parsing a core list, splitting cores among nodes and ranks, a rank's placement) are
pure functions; `apply` is the one place that changes the process."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

AUTO = "auto"


def parse_cores(text: str) -> tuple[int, ...]:
    """`0-3`, `0,2` or `0-1,4` -> the cores in order, each once; ValueError on anything else."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise ValueError(
                f"cpu_bind must be a core list like 0-1 or 0,2 (or auto), got {text!r}"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(f"cpu_bind: bad core range {part.strip()!r} in {text!r}")
        cores += [c for c in range(lo, hi + 1) if c not in cores]
    return tuple(cores)


def format_cores(cores: Iterable[int]) -> str:
    """The shortest core list: (0, 1, 2, 5) -> `0-2,5`."""
    out: list[str] = []
    run: list[int] = []
    for core in sorted(set(cores)):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [core]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def split_cores(cores: Sequence[int], weights: Sequence[int]) -> list[tuple[int, ...]]:
    """Share `cores` among consumers (nodes, or the ranks of a node) in proportion to their
    weights (a node's weight: its tensor-parallel size). With at least as many cores as weight
    units, every unit gets its own contiguous cores (sizes differ by one at most) and no core is
    shared; with fewer, every unit gets one core, the cores dealt round-robin."""
    if not cores:
        raise ValueError("no cores to split")
    if any(w < 1 for w in weights):
        raise ValueError(f"weights must be >= 1, got {list(weights)}")
    units = sum(weights)
    n = len(cores)
    if units <= n:
        unit_cores = [tuple(cores[u * n // units : (u + 1) * n // units]) for u in range(units)]
    else:
        unit_cores = [(cores[u % n],) for u in range(units)]
    out: list[tuple[int, ...]] = []
    u = 0
    for w in weights:
        share: list[int] = []
        for part in unit_cores[u : u + w]:
            share += [c for c in part if c not in share]
        out.append(tuple(share))
        u += w
    return out


@dataclass(frozen=True, slots=True)
class CpuPlacement:
    cores: tuple[int, ...] | None  # bound to these; None: left as it was
    threads: int

    def describe(self) -> str:
        where = "unbound" if self.cores is None else f"bound to cores {format_cores(self.cores)}"
        return f"{self.threads} intra-op thread{'s' * (self.threads != 1)}, {where}"


def placement(
    cpu_bind: str | None,
    cpu_threads: int | None,
    rank: int,
    size: int,
    available: Sequence[int],
) -> CpuPlacement:
    """Tensor-parallel rank `rank` of `size`'s placement. `available`: the cores this process may
    run on. cpu_bind: a core list or `auto` (the available cores), split among the ranks; unset:
    no binding. Threads: cpu_threads, else one per core of the rank's share (its bound cores, or
    its share of the available ones)."""
    pool = tuple(sorted(available)) if cpu_bind in (None, AUTO) else parse_cores(cpu_bind)
    share = split_cores(pool, [1] * size)[rank]
    return CpuPlacement(None if cpu_bind is None else share, cpu_threads or len(share))


def apply(place: CpuPlacement) -> CpuPlacement:
    """Bind this process and set torch's intra-op threads; returns the placement it replaced (to
    restore an in-process engine's at close)."""
    import torch

    before = CpuPlacement(tuple(sorted(os.sched_getaffinity(0))), torch.get_num_threads())
    if place.cores is not None and set(place.cores) != set(before.cores or ()):
        try:
            os.sched_setaffinity(0, place.cores)
        except OSError as exc:
            raise ValueError(
                f"cpu_bind: cannot bind to cores {format_cores(place.cores)}: {exc.strerror}"
            ) from None
    if place.threads != before.threads:
        torch.set_num_threads(place.threads)
    return before


def available_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def place_rank(
    cpu_bind: str | None, cpu_threads: int | None, rank: int, size: int
) -> tuple[CpuPlacement, CpuPlacement]:
    """Place this process, tensor-parallel rank `rank` of a CPU node's `size`, on its share of
    the cores it may use (`placement`, then `apply`): its placement, and the one it replaced."""
    place = placement(cpu_bind, cpu_threads, rank, size, available_cores())
    return place, apply(place)


def node_bindings(
    cpu_bind: str | None, sizes: Sequence[int], available: Sequence[int]
) -> list[str]:
    """The core lists of nodes started together on one host (their tensor-parallel `sizes`):
    disjoint shares of the cores given (`cpu_bind`, a core list) or else of `available`."""
    pool = tuple(sorted(available)) if cpu_bind in (None, AUTO) else parse_cores(cpu_bind)
    return [format_cores(share) for share in split_cores(pool, sizes)]
