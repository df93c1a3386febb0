"""The coordinator's view of its nodes: what each registered, its last reported load, and
whether it is alive. A node silent past the heartbeat timeout is dead, and so is one whose
connection to the coordinator closed and is not made again within a short grace: a process that
dies closes its sockets, which the coordinator sees at once, while ZeroMQ reconnects a live one
within its reconnect interval. Time is given, never read: the registry runs under a real or a
simulated clock alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cluster.node_messages import Heartbeat, KVTierReport, NodeRole, Register
from pdserve.engine.kv.groups import KVGroups, groups_for


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
    # Its main socket's connection closed then: the coordinator checks, a grace later, that it
    # is connected again.
    closed_at: float | None = None
    kv_error: str | None = None  # its KV receiver failed: admit no handoffs to it
    kv_blocks_received: int = 0  # blocks whose pages arrived at it (since it started)
    kv_bytes_sent: int = 0  # bytes of KV pages its handoffs sent (prefill), since it started
    kv_bytes_received: int = 0  # bytes of KV pages that arrived at it (decode), since it started
    kv_integrity_failures: int = 0  # sends to it whose pages failed their digest check
    kv_blocks_reused: int = 0  # blocks of prompts admitted to it found already cached there
    forced_tokens: int = 0  # output tokens its constraints forced (since it started)
    spec_draft_tokens: int = 0  # speculative decoding's verified drafts (since it started)
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # by draft position
    spec_draft_catch_up_tokens: int = 0  # a draft model's tokens computed to catch its KV up
    spec_draft_cached_tokens: int = 0  # and those its prefix cache held (since it started)
    kv_tiers: KVTierReport | None = None  # its KV tiers below the pool (since it started)
    prefill_tokens_computed: int = 0  # prompt tokens whose KV its steps computed (since start)
    # Of the last snapshot applied: the node's link session, and the messages it had sent there
    load_link_session: int = 0
    load_link_sent: int = 0

    @property
    def kv_groups(self) -> KVGroups | None:
        """Its model's KV groups where its layers are not all full attention (its KV layout's
        layer kinds), else None."""
        layout = self.kv_layout
        kinds = layout.get("layer_kinds")
        if not kinds:
            return None
        sizes = tuple(heads * dim for heads, dim in layout.get("layer_shapes", ()))
        return groups_for(layout["num_layers"], tuple(kinds), sizes)

    @property
    def decodes(self) -> bool:
        return self.role.decodes

    @property
    def available_blocks(self) -> int:
        return self.free_blocks - self.reserved_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens computed tokens holds here: in a model with windowed
        or chunked layers, their groups' blocks under the window alone."""
        groups = self.kv_groups
        if groups is None:
            return -(-num_tokens // self.block_size)
        return groups.blocks_read(num_tokens, self.block_size)

    @property
    def prefill_load(self) -> int:
        return self.queued_prefill_tokens + self.assigned_prefill_tokens


class NodeRegistry:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        # A connection whose owner is not known closed then: every node is checked a grace later.
        self.unattributed_close: float | None = None

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
        node.kv_bytes_sent = msg.kv_bytes_sent
        node.kv_bytes_received = msg.kv_bytes_received
        node.kv_blocks_reused = msg.kv_blocks_reused
        node.kv_integrity_failures = msg.kv_integrity_failures
        node.forced_tokens = msg.forced_tokens
        node.spec_draft_tokens = msg.spec_draft_tokens
        node.spec_accepted_tokens = msg.spec_accepted_tokens
        node.spec_accepted_per_position = list(msg.spec_accepted_per_position)
        node.spec_draft_catch_up_tokens = msg.spec_draft_catch_up_tokens
        node.spec_draft_cached_tokens = msg.spec_draft_cached_tokens
        node.kv_tiers = msg.kv_tiers
        node.prefill_tokens_computed = msg.prefill_tokens_computed
        node.load_link_session = msg.link_session
        node.load_link_sent = msg.link_sent
        node.reserved_blocks = 0
        node.assigned_prefill_tokens = 0
        return node

    def touch(self, node_id: str, now: float) -> None:
        node = self.nodes.get(node_id)
        if node is not None and node.alive:
            node.last_seen = now

    def by_identity(self, identity: bytes) -> NodeState | None:
        """The node whose main socket has this routing id."""
        node = self.nodes.get(identity.decode(errors="replace"))
        return node if node is not None and node.identity == identity else None

    def forgive(self, seconds: float) -> None:
        """The coordinator was not listening for `seconds` (a stalled loop): that silence is not
        the nodes', nor is a connection's slowness to come back then."""
        if self.unattributed_close is not None:
            self.unattributed_close += seconds
        for node in self.nodes.values():
            if node.alive:
                node.last_seen += seconds
                if node.closed_at is not None:
                    node.closed_at += seconds

    def connection_closed(self, identity: bytes | None, now: float) -> None:
        """A connection to the node socket closed at `now`: that of the main socket whose routing
        id is `identity`, or (None) one whose owner is not known, which has every node checked.
        A connection that closes again puts its check off: each gets the whole grace."""
        if identity is None:
            self.unattributed_close = now
            return
        node = self.by_identity(identity)
        if node is not None and node.alive:
            node.closed_at = now

    def connection_checks(self, now: float, grace_s: float) -> list[NodeState]:
        """The alive nodes whose connection must be checked now (is it made again?): those whose
        own closed grace_s ago or more, and, grace_s after a close of unknown owner, every node
        but those whose own check is still to come."""
        everyone = self.unattributed_close is not None and now - self.unattributed_close >= grace_s
        if everyone:
            self.unattributed_close = None
        due = []
        for node in self.alive():
            closed = node.closed_at
            if closed is not None and now - closed < grace_s:
                continue  # its own check comes later
            if closed is not None or everyone:
                node.closed_at = None
                due.append(node)
        return due

    def expire(self, timeout_s: float, now: float) -> list[NodeState]:
        """Mark dead the nodes silent past timeout_s; returns the newly dead."""
        dead = []
        for node in self.nodes.values():
            if node.alive and now - node.last_seen > timeout_s:
                node.alive = False
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
