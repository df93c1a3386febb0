"""Waiting in tests for what another thread or process will do: poll a condition until it holds,
or fail naming what was awaited once a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

# Deadlines for what must happen, not estimates of when: two shared cores can stall for seconds.
WAIT_S = 60.0

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    what: str = "the condition",
    timeout_s: float = WAIT_S,
    poll_s: float = 0.05,
) -> T:
    """Polls `condition` every `poll_s` until it returns something true, and returns that; fails
    naming `what` if `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(poll_s)
    return result
