"""Supervision of one host's processes for `pdserve launch`: start them, restart a process that
dies with exponential backoff (one that keeps dying within seconds of starting is a permanent
error: everything stops), say when the cluster serves (every node registered), and stop
gracefully (the coordinator drains first; a second signal stops everything at once). One log
file per process; a process that dies has the end of its log shown on the console."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster_file import ProcessPlan

logger = logging.getLogger("pdserve.launch")

TAIL_LINES = 20


@dataclass
class Supervised:
    plan: ProcessPlan
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0  # deaths in a row, each soon after its start
    next_start: float = 0.0  # when a dead process may start again
    done: bool = False  # exited cleanly (told to stop): not restarted
    history: list[int] = field(default_factory=list)  # exit codes


def log_tail(path: Path | None, lines: int = TAIL_LINES) -> str:
    """The last lines of a log file, indented for the console ('' if there is none)."""
    if path is None or not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join("  | " + line for line in text.splitlines()[-lines:])


def cluster_serves(status: int, health: object, nodes: dict[str, int]) -> bool:
    """Whether to say the cluster serves, from the coordinator's /health answer: it answers 200
    (a request can be served) and counts at least nodes[role] registered nodes of each role (so
    every node that was started is up, and requests go through disaggregated at once)."""
    if status != 200 or not isinstance(health, dict):
        return False
    registered = health.get("nodes")
    if not isinstance(registered, dict):
        return False
    return all(registered.get(role, 0) >= count for role, count in nodes.items())


def started_nodes(plans: list[ProcessPlan]) -> dict[str, int]:
    """The node processes of each role among plans (the coordinator is none)."""
    return dict(Counter(p.role for p in plans if p.role != "coordinator"))


class Supervisor:
    def __init__(
        self,
        plans: list[ProcessPlan],
        log_dir: Path | None,
        backoff_s: tuple[float, float] = (1.0, 30.0),
        stable_s: float = 60.0,
        drain_timeout_s: float = 30.0,
        serving_url: str | None = None,
        serving_nodes: dict[str, int] | None = None,
        quick_death_s: float = 10.0,
        max_quick_deaths: int = 3,
    ) -> None:
        """serving_url: the cluster's HTTP API, announced once its /health answers 200 with
        serving_nodes (by role; default: the nodes among plans) registered, or more.
        A process that exits within quick_death_s of its start max_quick_deaths times in a row
        (a port in use, a bad model path) stops the whole host with an error."""
        self.children = [Supervised(p) for p in plans]
        self.log_dir = log_dir
        self.backoff_min, self.backoff_max = backoff_s
        self.stable_s = stable_s
        self.drain_timeout_s = drain_timeout_s
        self.serving_url = serving_url
        self.serving_nodes = started_nodes(plans) if serving_nodes is None else serving_nodes
        self.quick_death_s = quick_death_s
        self.max_quick_deaths = max_quick_deaths
        self.signals = 0
        self.stop_requested_at: float | None = None
        self.failure: str | None = None  # why everything is being stopped, if by an error
        self._next_probe = 0.0

    def log_path(self, child: Supervised) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{child.plan.name}.log"

    def _start(self, child: Supervised) -> None:
        env = {**os.environ, **child.plan.env}
        out = None
        path = self.log_path(child)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "ab")  # noqa: SIM115
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
        lived = time.monotonic() - child.started_at
        child.quick_deaths = child.quick_deaths + 1 if lived < self.quick_death_s else 0
        tail = log_tail(self.log_path(child))
        where = f"; the end of {self.log_path(child)}:\n{tail}" if tail else ""
        if child.quick_deaths >= self.max_quick_deaths:
            self.failure = (
                f"{child.plan.name} exited ({code}) within {self.quick_death_s:.0f} s of "
                f"starting, {child.quick_deaths} times in a row; stopping everything{where}"
            )
            self._stop_all()
            return
        if lived > self.stable_s:
            child.restarts = 0  # it ran long enough: start the backoff over
        delay = min(self.backoff_max, self.backoff_min * 2**child.restarts)
        child.restarts += 1
        child.next_start = time.monotonic() + delay
        logger.warning("%s died (%d); restarting in %.1fs%s", child.plan.name, code, delay, where)

    def _stop_all(self) -> None:
        self.stop_requested_at = time.monotonic()
        for child in self.children:
            if child.proc is not None:
                child.proc.send_signal(signal.SIGTERM)

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

    def _announce_when_serving(self, now: float) -> None:
        """Print the cluster's URL once every node has registered (see cluster_serves), as
        `pdserve serve` does once its nodes have."""
        if self.serving_url is None or now < self._next_probe:
            return
        self._next_probe = now + 0.5
        try:
            with urllib.request.urlopen(self.serving_url + "/health", timeout=1) as response:
                status, health = response.status, json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):  # down, 503, or not JSON
            status, health = 0, None
        if cluster_serves(status, health, self.serving_nodes):
            print(f"pdserve: serving {self.serving_url}", flush=True)
            self.serving_url = None

    def run(self) -> int:
        """Until every process has exited: 0 after a clean stop, 1 after a permanent error."""
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        if self.log_dir is not None:
            print(f"pdserve: logs in {self.log_dir}", flush=True)
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
                    if self.failure is not None:
                        print(f"pdserve: error: {self.failure}", file=sys.stderr, flush=True)
                        return 1
                    return 0
                self._escalate()
            elif self.children and all(c.done for c in self.children):
                return 0  # everything was shut down by the coordinator
            else:
                self._announce_when_serving(now)
            time.sleep(0.1)
