"""A competing load: N processes that each keep one core busy (a Python busy loop) for as long as
the benchmark runs, so throughput is also measured the way a shared host sees it."""

from __future__ import annotations

import subprocess
import sys

BUSY_LOOP = "while True:\n    pass"


class CompetingLoad:
    """`with CompetingLoad(n):` starts n busy-loop processes, and stops them on the way out."""

    def __init__(self, processes: int) -> None:
        if processes < 0:
            raise ValueError("--competing-load takes a count of processes, 0 or more")
        self.processes = processes
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> CompetingLoad:
        for _ in range(self.processes):
            self.procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP]))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()
