"""The coordinator's periodic stats line (as vLLM logs one): prompt and generation throughput over
the last interval, requests decoding, prefilling, in KV transfer and waiting at the coordinator,
KV usage per node kind and the nodes' prefix-cache hit rate. It counts tokens as a listener of
the core and reads the core's state when asked; it reads no clock of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cluster.node_messages import NodeRole
from pdserve.coordinator.core import CoordinatorCore
from pdserve.coordinator.request_state import Phase, RequestState

INTERVAL_S = 10.0  # how often the coordinator logs the line while anything runs


@dataclass(slots=True)
class Stats:
    """One interval's figures."""

    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    running: int  # decoding on a decode node
    prefilling: int
    transferring: int  # admitted into a decode node, KV on its way
    waiting: int  # prefilled, waiting at the coordinator for room on a decode node
    kv_usage: dict[str, float] = field(default_factory=dict)  # node role -> used fraction
    prefix_cache_hit_rate: float | None = None  # over the nodes' lookups since they started

    def line(self) -> str:
        kv = ", ".join(f"{role} {used:.1%}" for role, used in self.kv_usage.items()) or "-"
        hits = "-" if self.prefix_cache_hit_rate is None else f"{self.prefix_cache_hit_rate:.1%}"
        return (
            f"prompt throughput {self.prompt_tokens_per_s:.1f} tokens/s, "
            f"generation throughput {self.generation_tokens_per_s:.1f} tokens/s, "
            f"running {self.running} reqs, prefilling {self.prefilling} reqs, "
            f"transferring {self.transferring} reqs, waiting {self.waiting} reqs, "
            f"KV cache usage {kv}, prefix cache hit rate {hits}"
        )


class StatsCounter:
    """Counts prompt tokens as they are prefilled and output tokens as they are generated (a
    listener of the core), and turns them into a `Stats` per interval."""

    def __init__(self, now: float) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._counted: dict[str, int] = {}  # request id -> output tokens counted so far
        self._last = (now, 0, 0)  # when the last interval ended, and the counts then

    def observe(self, name: str, state: RequestState) -> None:
        if name == "first_token":
            self.prompt_tokens += len(state.prompt_token_ids)
        # A request's last tokens are announced after its end, which already counted them.
        if name == "finished" or (name == "tokens" and not state.done):
            counted = self._counted.get(state.request_id, 0)
            self.generation_tokens += len(state.output_token_ids) - counted
            if name == "finished":
                self._counted.pop(state.request_id, None)
            else:
                self._counted[state.request_id] = len(state.output_token_ids)

    def sample(self, core: CoordinatorCore, now: float) -> Stats | None:
        """The interval since the last sample, ended now; None if nothing ran in it and nothing
        is running now (an idle server logs nothing)."""
        since, prompt, generation = self._last
        self._last = (now, self.prompt_tokens, self.generation_tokens)
        new_prompt, new_generation = (
            self.prompt_tokens - prompt,
            self.generation_tokens - generation,
        )
        if not core.requests and not new_prompt and not new_generation:
            return None
        elapsed = max(now - since, 1e-9)
        phases = [s.phase for s in core.requests.values()]
        nodes = core.nodes.alive()
        kv_usage = {}
        for role in NodeRole:
            of_role = [n for n in nodes if n.role is role and n.num_blocks > 0]
            if of_role:
                total = sum(n.num_blocks for n in of_role)
                kv_usage[role.value] = 1 - sum(n.free_blocks for n in of_role) / total
        lookups = sum(n.prefix_hits + n.prefix_misses for n in nodes)
        return Stats(
            prompt_tokens_per_s=new_prompt / elapsed,
            generation_tokens_per_s=new_generation / elapsed,
            running=phases.count(Phase.DECODING),
            prefilling=phases.count(Phase.PREFILLING) + phases.count(Phase.LOCAL_PREFILL),
            transferring=phases.count(Phase.ADMITTING) + phases.count(Phase.TRANSFERRING),
            waiting=phases.count(Phase.WAITING_ADMISSION) + phases.count(Phase.WAITING_NODE),
            kv_usage=kv_usage,
            prefix_cache_hit_rate=sum(n.prefix_hits for n in nodes) / lookups if lookups else None,
        )
