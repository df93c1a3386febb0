"""Admission of prefilled sequences into decode nodes: a FIFO of sequences waiting at the
coordinator; the head enters the decode node with room for it above the watermark, in order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.coordinator.nodes import NodeState
from pdserve.coordinator.routing import has_room, most_free_blocks


@dataclass(slots=True)
class Candidate:
    request_id: str
    num_blocks: int  # blocks its prefilled KV takes on a decode node


class AdmissionQueue:
    def __init__(self) -> None:
        self.queue: deque[Candidate] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, candidate: Candidate, front: bool = False) -> None:
        (self.queue.appendleft if front else self.queue.append)(candidate)

    def remove(self, request_id: str) -> None:
        self.queue = deque(c for c in self.queue if c.request_id != request_id)

    def admit(
        self,
        nodes: list[NodeState],
        watermark: float,
        choose: Callable[[Candidate, list[NodeState]], NodeState | None] | None = None,
    ) -> list[tuple[Candidate, NodeState]]:
        """Pop every head that fits somewhere, in order; stop at the first that fits nowhere.
        choose(head, fitting nodes) picks among those with room (default: most free blocks).
        Reserves the blocks on the chosen node so one report is not spent twice."""
        decisions = []
        while self.queue:
            head = self.queue[0]
            fitting = [n for n in nodes if has_room(n, head.num_blocks, watermark)]
            node = choose(head, fitting) if choose is not None and fitting else None
            node = node or most_free_blocks(fitting)
            if node is None:
                break  # first come, first served: nobody overtakes the head
            self.queue.popleft()
            node.reserved_blocks += head.num_blocks
            decisions.append((head, node))
        return decisions
