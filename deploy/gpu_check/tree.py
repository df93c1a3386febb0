"""The exact tree a GPU check ran: its commit plus a hash of its changes (`git diff HEAD` and the
untracked files that travel with it), so that every figure names the code that produced it.

A checkout's git says this at once. A tree that travels as files (a lent GPU machine gets a copy
of the working tree, whose git, if any, need not be the checkout's) cannot say it itself: there
the stamp written before it travelled says it, once the files are seen to be the ones stamped.

    python -m pdserve.deploy.gpu_check.tree          # write gpu-check-tree.json (git-ignored: carry it)
    python -m pdserve.deploy.gpu_check.tree --show   # the tree a check started here would record
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.deploy.gpu_check import deps

# Written at the checkout's root on the host before the tree travels; git-ignored, so it goes
# along by `carry` (or by copying it with the checkout), never by a commit.
STAMP = "gpu-check-tree.json"
SHORT = 12  # hex digits of a hash in the report


def _git(repo: Path, *args: str) -> bytes | None:
    """git's output, or None where there is no git or no checkout."""
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _names(raw: bytes) -> list[str]:
    return [n for n in raw.decode().split("\0") if n and n != STAMP]


def files_digest(repo: Path, names: list[str]) -> str:
    """sha256 over each file's name and contents, in name order; a missing file counts as such."""
    total = hashlib.sha256()
    for name in sorted(names):
        path = repo / name
        content = path.read_bytes() if path.is_file() else b"\0missing"
        total.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return total.hexdigest()


def git_tree(repo: Path = deps.REPO) -> dict[str, Any] | None:
    """The checkout's tree by its git: commit, the hash of its changes (`git diff HEAD --binary`,
    then each untracked, not ignored file), how many files differ, and the hash of every file
    that would travel (to verify a stamp by). None without git."""
    head = _git(repo, "rev-parse", "HEAD")
    diff = _git(repo, "diff", "HEAD", "--binary")
    untracked = _git(repo, "ls-files", "-z", "--others", "--exclude-standard")
    travelling = _git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    changed = _git(repo, "diff", "HEAD", "--name-only", "-z")
    if None in (head, diff, untracked, travelling, changed):
        return None
    new = _names(untracked)
    changes = hashlib.sha256(diff)
    changes.update(files_digest(repo, new).encode())
    files = [n for n in _names(travelling) if (repo / n).is_file()]
    return {
        "commit": head.decode().strip(),
        "changed_files": len(_names(changed)) + len(new),
        "diff_sha256": changes.hexdigest(),
        "files": files,
        "files_sha256": files_digest(repo, files),
    }


def write_stamp(repo: Path = deps.REPO) -> Path:
    """The stamp at the checkout's root, from its git: written before the tree travels."""
    tree = git_tree(repo)
    if tree is None:
        raise SystemExit(
            f"{repo} is no git checkout: the stamp is written where git knows the tree"
        )
    tree["stamped"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    path = repo / STAMP
    path.write_text(json.dumps(tree, indent=1) + "\n")
    return path


def _stamped(repo: Path) -> tuple[dict[str, Any] | None, str]:
    """The stamp when the files are the ones it names, else None and why not."""
    path = repo / STAMP
    if not path.exists():
        return None, ""
    try:
        stamp = json.loads(path.read_text())
        names, expected = stamp["files"], stamp["files_sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{STAMP} unreadable ({type(exc).__name__})"
    if files_digest(repo, names) != expected:
        return None, f"{STAMP} of {stamp.get('stamped', '?')} does not match the files"
    return stamp, ""


def tree(repo: Path = deps.REPO) -> dict[str, Any]:
    """The tree a run records: from a stamp that matches the files, else from git, else unknown;
    `source` says which (and why a stamp present was not used)."""
    stamp, why_not = _stamped(repo)
    if stamp is not None:
        found, source = stamp, f"{STAMP} of {stamp.get('stamped', '?')}, files verified"
    else:
        found, source = git_tree(repo), "git"
        if found is None:
            found = {"commit": None, "changed_files": None, "diff_sha256": None}
            source = f"unknown: no git checkout and no {STAMP} (`python -m {__spec__.name}`)"
    if why_not:
        source += f"; {why_not}"
    keep = ("commit", "changed_files", "diff_sha256", "files_sha256")
    return {k: found.get(k) for k in keep} | {"source": source, "label": label(found)}


def label(found: dict[str, Any]) -> str:
    """`<commit>` for a clean tree, `<commit> + diff <hash> (N files)` otherwise."""
    if not found.get("commit"):
        return "unknown tree"
    commit = found["commit"][:SHORT]
    n = found.get("changed_files") or 0
    if n == 0:
        return commit
    return f"{commit} + diff {found['diff_sha256'][:SHORT]} ({n} file{'s' if n != 1 else ''})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--repo", type=Path, default=deps.REPO)
    parser.add_argument("--show", action="store_true", help="print the tree, write nothing")
    args = parser.parse_args(argv)
    if args.show:
        found = tree(args.repo)
        print(f"{found['label']} ({found['source']})")
        return 0
    path = write_stamp(args.repo)
    print(f"wrote {path}: {label(json.loads(path.read_text()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
