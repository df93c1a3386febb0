"""The coordinator's view of its nodes: what each registered, its last reported load, and
whether it is alive (a node silent past the heartbeat timeout is dead, and so is one that stays
silent for a short grace after a connection to the coordinator closed: a process that dies
closes its sockets, which the coordinator sees at once, though not whose they were). Time is
given, never read: the registry runs under a real or a simulated clock alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cluster.node_messages import Heartbeat, NodeRole, Register


@dataclass(slots=True)
class NodeState:
    node_id: str
    role: NodeRole
    identity: bytes  # its ZMQ routing id
    num_blocks: int
    block_size: int
    max_model_len: int
    transport: str
    receiver_info: dict
    kv_layout: dict
    pid: int = 0
    alive: bool = True
    last_seen: float = 0.0
    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    reserved_blocks: int = 0  # admitted since its last report, not yet in free_blocks
    assigned_prefill_tokens: int = 0  # routed since its last report
    load_seq: int = -1  # the last load snapshot applied
    roll_call: float | None = None  # a connection closed then: it must be heard from since
    kv_error: str | None = None  # its KV receiver failed: admit no handoffs to it
    kv_blocks_received: int = 0  # blocks whose pages arrived at it (since it started)
    kv_integrity_failures: int = 0  # sends to it whose pages failed their digest check
    kv_blocks_reused: int = 0  # blocks of prompts admitted to it found already cached there
    forced_tokens: int = 0  # output tokens its constraints forced (since it started)
    spec_draft_tokens: int = 0  # speculative decoding's verified drafts (since it started)
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # by draft position

    @property
    def decodes(self) -> bool:
        return self.role.decodes

    @property
    def available_blocks(self) -> int:
        return self.free_blocks - self.reserved_blocks

    @property
    def prefill_load(self) -> int:
        return self.queued_prefill_tokens + self.assigned_prefill_tokens


class NodeRegistry:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}

    def register(self, msg: Register, identity: bytes, now: float) -> NodeState:
        node = NodeState(
            node_id=msg.node_id,
            role=msg.role,
            identity=identity,
            num_blocks=msg.num_blocks,
            block_size=msg.block_size,
            max_model_len=msg.max_model_len,
            transport=msg.transport,
            receiver_info=msg.receiver_info,
            kv_layout=msg.kv_layout,
            pid=msg.pid,
            last_seen=now,
            free_blocks=msg.num_blocks,
        )
        self.nodes[msg.node_id] = node
        return node

    def heartbeat(self, msg: Heartbeat, now: float) -> NodeState | None:
        node = self.nodes.get(msg.node_id)
        if node is None or not node.alive:
            return None
        node.last_seen = now
        node.kv_error = msg.kv_error
        if msg.seq == node.load_seq:
            return node  # alive, but busy in a step: keep the reservations made since
        node.load_seq = msg.seq
        node.free_blocks = msg.free_blocks
        node.num_blocks = msg.total_blocks
        node.running = msg.running
        node.waiting = msg.waiting
        node.queued_prefill_tokens = msg.queued_prefill_tokens
        node.prefix_hits = msg.prefix_hits
        node.prefix_misses = msg.prefix_misses
        node.kv_blocks_received = msg.kv_blocks_received
        node.kv_blocks_reused = msg.kv_blocks_reused
        node.kv_integrity_failures = msg.kv_integrity_failures
        node.forced_tokens = msg.forced_tokens
        node.spec_draft_tokens = msg.spec_draft_tokens
        node.spec_accepted_tokens = msg.spec_accepted_tokens
        node.spec_accepted_per_position = list(msg.spec_accepted_per_position)
        node.reserved_blocks = 0
        node.assigned_prefill_tokens = 0
        return node

    def touch(self, node_id: str, now: float) -> None:
        node = self.nodes.get(node_id)
        if node is not None and node.alive:
            node.last_seen = now

    def forgive(self, seconds: float) -> None:
        """The coordinator was not listening for `seconds` (a stalled loop): that silence is not
        the nodes'."""
        for node in self.nodes.values():
            if node.alive:
                node.last_seen += seconds
                if node.roll_call is not None:
                    node.roll_call += seconds

    def call_roll(self, now: float) -> None:
        """A connection closed at `now` (whose node's, the socket does not say): every node
        alive must be heard from again (see `expire`)."""
        for node in self.nodes.values():
            if node.alive and node.roll_call is None:
                node.roll_call = now

    def expire(
        self, timeout_s: float, now: float, grace_s: float = float("inf")
    ) -> list[NodeState]:
        """Mark dead the nodes silent past timeout_s, and those not heard from within grace_s
        of a roll call; returns the newly dead."""
        dead = []
        for node in self.nodes.values():
            if not node.alive:
                continue
            called = node.roll_call
            if called is not None and node.last_seen > called:
                node.roll_call = called = None  # it answered
            if now - node.last_seen > timeout_s or (called is not None and now - called > grace_s):
                node.alive = False
                node.roll_call = None
                dead.append(node)
        return dead

    def alive(self, predicate=None) -> list[NodeState]:  # noqa: ANN001
        return [n for n in self.nodes.values() if n.alive and (predicate is None or predicate(n))]

    def prefill_nodes(self) -> list[NodeState]:
        return self.alive(lambda n: n.role is NodeRole.PREFILL)

    def decode_nodes(self) -> list[NodeState]:
        return self.alive(lambda n: n.decodes)

    def count_by_role(self) -> dict[str, int]:
        """Alive nodes of each role, every role named (what /health tells a launcher)."""
        counts = dict.fromkeys(NodeRole, 0)
        for node in self.alive():
            counts[node.role] += 1
        return {role.value: n for role, n in counts.items()}

    def kv_receivers(self) -> list[NodeState]:
        """Decode nodes that can take a prefilled sequence's KV now."""
        return self.alive(lambda n: n.role is NodeRole.DECODE and n.kv_error is None)
