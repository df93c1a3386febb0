"""What an attention layer's queries read of the context, which is all the KV manager needs to
know of a layer: every token (full attention), the last W tokens (a sliding window), or the
tokens of the current chunk of C (chunked local attention). A layer with attention sinks reads
as its window kind does: a sink is a logit, not a cached token. A linear-attention layer (Gated
DeltaNet) reads no tokens at all, only its recurrent state as of the token before the query,
which it keeps in the page of that token's block (`LinearState`, `pdserve.engine.kv.state_pages`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FullAttention:
    """Every earlier token."""

    def first_read(self, position: int) -> int:
        """The first key position the query at `position` reads."""
        return 0

    @property
    def reach(self) -> int | None:
        """The most tokens before a query that it reads (None: all of them)."""
        return None

    def kernel_args(self) -> dict[str, int]:
        """What the attention op is told of the layer's mask."""
        return {}

    @property
    def label(self) -> str:
        return "full"


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """The last `window` tokens, the query's own included (transformers' `sliding_window`)."""

    window: int

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window must hold at least one token, got {self.window}")

    def first_read(self, position: int) -> int:
        return max(0, position - self.window + 1)

    @property
    def reach(self) -> int:
        return self.window - 1

    def kernel_args(self) -> dict[str, int]:
        return {"window": self.window}

    @property
    def label(self) -> str:
        return f"sliding {self.window}"


@dataclass(frozen=True, slots=True)
class ChunkedLocal:
    """The earlier tokens of the query's own chunk of `chunk` tokens (Llama 4's local layers)."""

    chunk: int

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"an attention chunk must hold at least one token, got {self.chunk}")

    def first_read(self, position: int) -> int:
        return position - position % self.chunk

    @property
    def reach(self) -> int:
        return self.chunk - 1

    def kernel_args(self) -> dict[str, int]:
        return {"chunk": self.chunk}

    @property
    def label(self) -> str:
        return f"chunked {self.chunk}"


@dataclass(frozen=True, slots=True)
class LinearState:
    """A linear-attention layer: its state (a short convolution window and a recurrent matrix
    per head) as of each block's last token lives in that block's page of the layer. The query
    at position p reads the state in the block of p - 1 and writes its own in the block of p, so
    a block left behind holds the state at its end: a snapshot at that block boundary, cached
    like any full block, which a later prompt sharing the prefix restores."""

    def first_read(self, position: int) -> int:
        return max(0, position - 1)

    @property
    def reach(self) -> int:
        return 1

    def kernel_args(self) -> dict[str, int]:
        return {}

    @property
    def label(self) -> str:
        return "linear"


LayerKind = FullAttention | SlidingWindow | ChunkedLocal | LinearState


def parse_kind(label: str) -> LayerKind:
    """A kind from its label ("full", "sliding 128", "chunked 8192", "linear"), as layouts
    carry it."""
    name, _, size = label.partition(" ")
    if name == "full" and not size:
        return FullAttention()
    if name == "linear" and not size:
        return LinearState()
    if name == "sliding" and size.isdigit():
        return SlidingWindow(int(size))
    if name == "chunked" and size.isdigit():
        return ChunkedLocal(int(size))
    raise ValueError(f"unknown attention layer kind {label!r}")
