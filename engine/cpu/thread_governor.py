"""How many intra-op threads a CPU engine runs its steps with, from one moment to the next.

OpenMP threads meet at a barrier after every parallel op. When other processes hold the cores,
the scheduler deschedules each thread part of the time, and each op waits for the slowest: two
threads sharing two cores with two busy processes ran a 9M-parameter model 20x slower than alone,
while one thread lost only the share of a core the others took. So the engine watches its own
steps: if its threads got well under a core each while they stepped and its cores did not sit
idle meanwhile, other processes hold them and it drops to one thread; while on one thread, if the
other cores of its set sat idle, it goes back to all of them. A return that is contended again at once doubles the wait before the next try.

`ThreadGovernor` decides from measurements handed to it (pure: tested alone); `CpuTimes` reads
them (this process's CPU time, and the idle time of its cores from /proc/stat).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

# A thread that ran less than this share of a core while its steps ran was descheduled.
DESCHEDULED_SHARE = 0.75
# On one thread, the other cores count as free when this share of each sat idle.
FREE_SHARE = 0.8
WINDOW_S = 0.5  # measurements are taken over at least this much stepping
HOLD_S = 2.0  # the first wait on one thread before trying all of them again
MAX_HOLD_S = 60.0


@dataclass(frozen=True, slots=True)
class Window:
    """What the engine measured since the last decision."""

    wall_s: float  # wall time since the last decision
    step_s: float  # of which, inside steps
    cpu_s: float  # this process's CPU time inside those steps
    idle_cores: float  # idle time of the process's cores over the window / wall_s (in cores)


class ThreadGovernor:
    def __init__(self, most: int, now: float = 0.0) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self.most = most
        self.threads = most
        self.hold_s = HOLD_S
        self.hold_until = now
        self._raised_at: float | None = None  # when it last went back to `most`

    def decide(self, window: Window, now: float) -> int:
        """The thread count for the steps after `window` (ending at `now`)."""
        if self.most == 1 or window.step_s <= 0:
            return self.threads
        if self.threads > 1:
            share = window.cpu_s / (window.step_s * self.threads)
            # Threads that ran little while the other cores sat idle were not descheduled: the
            # step ran one thread's work (torch.compile compiling a shape, Python between ops).
            taken = window.idle_cores < (self.most - 1) * FREE_SHARE
            if share < DESCHEDULED_SHARE and taken:
                # Contended again right after a return: wait twice as long before the next one.
                recent = self._raised_at is not None and now - self._raised_at < 2 * WINDOW_S + 1
                self.hold_s = min(MAX_HOLD_S, self.hold_s * 2) if recent else HOLD_S
                self.hold_until = now + self.hold_s
                self.threads = 1
        elif now >= self.hold_until and window.idle_cores >= (self.most - 1) * FREE_SHARE:
            self.threads = self.most
            self._raised_at = now
        return self.threads


def proc_stat_idle(text: str, cores: Sequence[int]) -> float:
    """Seconds the given cores have been idle (idle + iowait), from /proc/stat's text."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    wanted = {f"cpu{c}" for c in cores}
    total = 0
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            total += int(fields[4]) + int(fields[5])
    return total / ticks


class CpuTimes:
    """Reads the measurements for `ThreadGovernor` around an engine's steps."""

    def __init__(self, cores: Sequence[int]) -> None:
        self.cores = tuple(cores)
        self.readable = os.path.exists("/proc/stat")
        self.reset()

    def reset(self) -> None:
        self.start_wall = time.monotonic()
        self.start_idle = self.idle()
        self.step_s = 0.0
        self.cpu_s = 0.0

    def idle(self) -> float:
        if not self.readable:
            return 0.0
        with open("/proc/stat") as f:
            return proc_stat_idle(f.read(), self.cores)

    def add_step(self, wall_s: float, cpu_s: float) -> None:
        self.step_s += wall_s
        self.cpu_s += cpu_s

    def window(self) -> Window | None:
        """The window so far, once it holds enough stepping; None before."""
        if self.step_s < WINDOW_S:
            return None
        wall = time.monotonic() - self.start_wall
        return Window(wall, self.step_s, self.cpu_s, (self.idle() - self.start_idle) / wall)
