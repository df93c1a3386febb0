"""The resident memory of a running `pdserve serve` and its node processes, read from /proc: what
a soak samples over time to show that no process grows with the requests it has served."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def resident_mib(pid: int) -> dict[str, float] | None:
    """A process's resident memory in MiB, or None once it has gone: `rss` (all of it, VmRSS),
    `anon` (its private memory: what a leak grows) and `shmem` (pages of shared memory it has
    touched, such as a KV pool of the shm transport, which grows up to the pool's size as its
    blocks are first written)."""
    fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem"}
    found: dict[str, float] = {}
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            key = fields.get(line.split(maxsplit=1)[0] if line else "")
            if key is not None:
                found[key] = int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return found if len(found) == len(fields) else None


def title(pid: int) -> str | None:
    """A process's title: pdserve's processes name themselves (`pdserve-prefill-0`)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    words = raw.replace(b"\0", b" ").split()
    return words[0].decode(errors="replace") if words else ""


def children(pid: int) -> list[int]:
    """The direct children of a process (from every thread's list)."""
    found: list[int] = []
    try:
        for task in (PROC / str(pid) / "task").iterdir():
            text = (task / "children").read_text()
            found += [int(c) for c in text.split()]
    except (FileNotFoundError, ProcessLookupError):
        return []
    return sorted(set(found))


def pdserve_processes(root: int) -> dict[str, int]:
    """The coordinator (`root`, as `coordinator`) and its node processes, by title: every
    `pdserve-*` descendant, a tensor-parallel rank's included."""
    found = {"coordinator": root}
    todo = children(root)
    while todo:
        pid = todo.pop()
        name = title(pid)
        if name and name.startswith("pdserve-"):
            found[name.removeprefix("pdserve-")] = pid
        todo += children(pid)
    return found
