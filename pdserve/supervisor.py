"""Supervision of one host's processes for `pdserve launch`: start them, restart a process that
dies with exponential backoff, and stop gracefully (the coordinator drains first; a second
signal stops everything at once). One log file per process."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster_file import ProcessPlan

logger = logging.getLogger("pdserve.launch")


@dataclass
class Supervised:
    plan: ProcessPlan
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0  # when a dead process may start again
    done: bool = False  # exited cleanly (told to stop): not restarted
    history: list[int] = field(default_factory=list)  # exit codes


class Supervisor:
    def __init__(
        self,
        plans: list[ProcessPlan],
        log_dir: Path | None,
        backoff_s: tuple[float, float] = (1.0, 30.0),
        stable_s: float = 60.0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.children = [Supervised(p) for p in plans]
        self.log_dir = log_dir
        self.backoff_min, self.backoff_max = backoff_s
        self.stable_s = stable_s
        self.drain_timeout_s = drain_timeout_s
        self.signals = 0
        self.stop_requested_at: float | None = None

    def _start(self, child: Supervised) -> None:
        env = {**os.environ, **child.plan.env}
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{child.plan.name}.log", "ab")  # noqa: SIM115
        child.proc = subprocess.Popen(
            child.plan.command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None
        )
        if out is not None:
            out.close()  # the child holds its own descriptor
        child.started_at = time.monotonic()
        logger.info("started %s (pid %d)", child.plan.name, child.proc.pid)

    def _on_exit(self, child: Supervised, code: int) -> None:
        child.history.append(code)
        child.proc = None
        if code == 0 or self.stop_requested_at is not None:
            child.done = True  # told to stop (or stopping): leave it
            logger.info("%s exited (%d)", child.plan.name, code)
            return
        if time.monotonic() - child.started_at > self.stable_s:
            child.restarts = 0  # it ran long enough: start the backoff over
        delay = min(self.backoff_max, self.backoff_min * 2**child.restarts)
        child.restarts += 1
        child.next_start = time.monotonic() + delay
        logger.warning("%s died (%d); restarting in %.1fs", child.plan.name, code, delay)

    def _signal(self, signum: int, frame: object) -> None:  # noqa: ARG002
        self.signals += 1
        if self.signals == 1:
            logger.info("stopping: the coordinator drains, then every process exits")
            self.stop_requested_at = time.monotonic()
            first = [c for c in self.children if c.plan.role == "coordinator"] or self.children
            for child in first:
                if child.proc is not None:
                    child.proc.send_signal(signal.SIGTERM)
        else:
            logger.warning("second signal: stopping every process now")
            for child in self.children:
                if child.proc is not None:
                    child.proc.kill()

    def _escalate(self) -> None:
        """After the drain: nodes that are still up get SIGTERM, then SIGKILL."""
        waited = time.monotonic() - (self.stop_requested_at or time.monotonic())
        for child in self.children:
            if child.proc is None:
                continue
            if waited > self.drain_timeout_s + 10:
                child.proc.kill()
            elif waited > self.drain_timeout_s + 2 or not any(
                c.plan.role == "coordinator" and c.proc is not None for c in self.children
            ):
                child.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        for child in self.children:
            self._start(child)
        while True:
            now = time.monotonic()
            for child in self.children:
                if child.proc is not None:
                    code = child.proc.poll()
                    if code is not None:
                        self._on_exit(child, code)
                elif not child.done and self.stop_requested_at is None and now >= child.next_start:
                    self._start(child)
            if self.stop_requested_at is not None:
                if all(c.proc is None for c in self.children):
                    return 0
                self._escalate()
            elif self.children and all(c.done for c in self.children):
                return 0  # everything was shut down by the coordinator
            time.sleep(0.1)
