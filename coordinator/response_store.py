"""The Responses API's stored responses (`store: true`): each response object with its
conversation as chat messages, for `previous_response_id` and `GET /v1/responses/{id}`, kept in
the coordinator's memory, bounded by count (least recently used dropped first) and by age."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict  # the response object, as a client got it
    # The conversation up to and including this response's output, as chat messages (without
    # its instructions, which a follow-up does not inherit).
    messages: list[dict]
    stored_at: float


class ResponseStore:
    """Bounds are read at each call (live settings): `limits()` gives (max count, ttl seconds)."""

    def __init__(
        self, limits: Callable[[], tuple[int, float]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limits = limits
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, response: dict, messages: list[dict]) -> None:
        self._items[response_id] = StoredResponse(response, messages, self._clock())
        self._items.move_to_end(response_id)
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, None when it was never stored, was dropped or has expired."""
        self._evict()
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        self._evict()
        return self._items.pop(response_id, None) is not None

    def _evict(self) -> None:
        most, ttl = self._limits()
        oldest = self._clock() - ttl
        for key in [k for k, v in self._items.items() if v.stored_at < oldest]:
            del self._items[key]
        while len(self._items) > most:
            self._items.popitem(last=False)
