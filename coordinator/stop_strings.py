"""Stop strings over streamed text: a match may span any number of chunks, so the tail that
could still begin one is held back; the output ends just before the earliest match."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]
        # A match not yet complete starts within the last len(longest) - 1 characters.
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""  # text seen but not yet released
        self.matched: str | None = None  # the stop string found, once found

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> str:
        """Add decoded text; returns the text now safe to emit (nothing once stopped)."""
        if self.stopped:
            return ""
        buffer = self.pending + text
        hit = self._earliest(buffer)
        if hit is not None:
            index, self.matched = hit
            self.pending = ""
            return buffer[:index]
        cut = max(0, len(buffer) - self.hold)
        self.pending = buffer[cut:]
        return buffer[:cut]

    def flush(self) -> str:
        """At the end of generation: the held-back tail, which matched no stop string."""
        text, self.pending = ("" if self.stopped else self.pending), ""
        return text

    def _earliest(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            index = text.find(s)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, s)
        return best
