"""What one gpu-check step hands back: a JSON file it rewrites as it goes (so a step cut short by
its time box still leaves what it found), with a status, a one-line summary, failures (where and
what), headline figures and its raw data; and the arguments every step script takes."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


class StepRecord:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.status = "running"
        self.summary = ""
        self.failures: list[dict[str, str]] = []
        self.notes: list[str] = []
        self.figures: dict[str, Any] = {}
        self.data: dict[str, Any] = {}
        self.save()

    def fail(self, where: str, what: str) -> None:
        self.failures.append({"where": where, "what": what})
        self.save()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1, default=str))
        tmp.replace(self.path)  # whole files only, whenever the step is stopped

    def finish(self, summary: str, status: str | None = None) -> None:
        self.summary = summary
        self.status = status or ("failed" if self.failures else "passed")
        self.save()

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "summary": self.summary,
            "failures": self.failures,
            "notes": self.notes,
            "figures": self.figures,
            "data": self.data,
        }


class Deadline:
    """The step's own end: it stops starting work in time to write its record."""

    def __init__(self, at: float) -> None:
        self.at = at

    def left(self) -> float:
        return self.at - time.time()

    def passed(self) -> bool:
        return self.left() <= 0


def step_args(description: str, argv: list[str] | None = None, **extra: dict) -> argparse.Namespace:
    """--json (the record), --work (scratch and logs), --deadline (unix time), --long; `extra`
    adds flags: name -> add_argument keywords."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", required=True, help="the step's record")
    parser.add_argument("--work", default=".", help="scratch and logs of this step")
    parser.add_argument("--deadline", type=float, default=None, help="unix time to be done by")
    parser.add_argument("--long", action="store_true", help="the full sweeps, for the docs")
    for name, kwargs in extra.items():
        parser.add_argument(name, **kwargs)
    args = parser.parse_args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    args.deadline = Deadline(args.deadline or time.time() + 3600)
    return args
