"""Processes under /proc, as a benchmark that starts and kills them needs them: a process's
children, a tensor-parallel node's ranks, and the sessions it started, to find strays in."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live child of pid."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is None or stat[0] == "Z" or int(stat[1]) != pid:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((int(entry.name), cmdline))
    return out


def in_sessions(sessions: set[int]) -> list[tuple[int, str]]:
    """(pid, command line) of every live process of these sessions (not zombies)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is None or stat[0] == "Z" or int(stat[3]) not in sessions:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = "?"
        found.append((int(entry.name), cmdline.strip()))
    return found


def rank_pid(node_pid: int, rank: int = 1) -> int | None:
    """The pid of a node's tensor-parallel rank (a child of the node running the worker)."""
    for pid, cmdline in children(node_pid):
        if f"pdserve-tp-rank{rank}" in cmdline:
            return pid
    ranks = [pid for pid, cmdline in children(node_pid) if "pdserve.engine.tp.worker" in cmdline]
    return ranks[rank - 1] if len(ranks) >= rank else None  # not titled yet: spawn order


class Sessions:
    """The sessions of every process group this bench starts (each node, `pdserve launch`):
    whatever is left in them at the end is a stray."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def add(self, pid: int) -> None:
        self.ids.add(pid)

    def strays(self, grace_s: float = 10.0) -> list[tuple[int, str]]:
        deadline = time.monotonic() + grace_s  # processes told to stop may take a moment
        while (left := in_sessions(self.ids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def kill_strays(self, strays: list[tuple[int, str]]) -> None:
        for pid, _ in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
