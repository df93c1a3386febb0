"""The coordinator's decisions, without sockets: wire protocol, routing, admission."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.cluster import node_messages
from pdserve.cluster.codec import ProtocolError, seal
from pdserve.cluster.node_messages import (
    FinishReason,
    Heartbeat,
    NodeRole,
    Register,
    TokenItem,
    TokenLogprobs,
    Tokens,
)
from pdserve.coordinator.admission import AdmissionQueue, Candidate
from pdserve.coordinator.nodes import NodeRegistry, NodeState
from pdserve.coordinator.routing import least_loaded, most_free_blocks


def node(node_id: str, role: str = "decode", free: int = 100, total: int = 100, **kw) -> NodeState:
    role = NodeRole(role)
    return NodeState(
        node_id=node_id,
        role=role,
        identity=node_id.encode(),
        num_blocks=total,
        block_size=4,
        max_model_len=512,
        transport="tcp",
        receiver_info={},
        free_blocks=free,
        **{"kv_layout": {}} | kw,
    )


# --- protocol ----------------------------------------------------------------------------------


def test_tokens_round_trip():
    lp = TokenLogprobs(7, -0.1, [(7, -0.1), (3, -2.5)])
    msg = Tokens("decode-0", [TokenItem("r#0", 5), TokenItem("r#1", 7, FinishReason.STOP, lp)])
    assert node_messages.reports.decode(node_messages.reports.encode(msg)) == msg


V = node_messages.NODE_PROTOCOL_VERSION


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        seal(msgpack.packb([1, 2, 3])),
        seal(msgpack.packb([99, {"type": "abort", "request_id": "x"}])),
        seal(msgpack.packb([V, {"type": "nonsense"}])),
        seal(msgpack.packb([V, {"type": "abort", "request_id": "x", "bogus": 1}])),
        seal(msgpack.packb([V, {"type": "abort", "request_id": 5}])),
        seal(msgpack.packb([V, {"type": "abort", "request_id": "x"}]))[:-1],  # cut short
        node_messages.orders.encode(node_messages.Abort("x")).replace(b"x", b"y"),  # changed
    ],
)
def test_malformed_frames_are_refused(frame):
    with pytest.raises(ProtocolError):
        node_messages.orders.decode(frame)


# --- routing -----------------------------------------------------------------------------------


def test_least_loaded_prefill_takes_the_shortest_queue():
    a, b = (
        node("a", "prefill", queued_prefill_tokens=500),
        node("b", "prefill", queued_prefill_tokens=20),
    )
    assert least_loaded([a, b]) is b
    b.assigned_prefill_tokens = 1000  # routed since its last report
    assert least_loaded([a, b]) is a


def test_decode_choice_prefers_most_free_kv():
    a, b = node("a", free=30, total=100), node("b", free=50, total=200)
    assert most_free_blocks([a, b]) is a  # 30% free beats 25%


# --- admission ---------------------------------------------------------------------------------


def test_admission_is_first_come_first_served_and_reserves_blocks():
    queue = AdmissionQueue()
    d = node("d", free=20, total=100, running=1)
    for rid, blocks in (("r1", 8), ("r2", 8), ("r3", 2)):
        queue.push(Candidate(rid, blocks))
    admitted = queue.admit([d], watermark=0.05)
    # 20 free, 5 kept back: r1 (8) fits, r2 (8) would leave 4 < 5, so r2 waits and r3 with it.
    assert [c.request_id for c, _ in admitted] == ["r1"]
    assert d.reserved_blocks == 8 and len(queue) == 2
    d.free_blocks, d.reserved_blocks = 40, 0  # the next report
    assert [c.request_id for c, _ in queue.admit([d], 0.05)] == ["r2", "r3"]


def test_a_nodes_block_estimate_counts_each_kv_group_under_its_window():
    """What the coordinator reserves for a prompt on a node (a local prefill, an early
    admission) is what the node's KV manager allocates for it: a windowed group's blocks under
    the window alone, beside the full group's every block."""
    from pdserve.coordinator.routing import early_blocks
    from pdserve.engine.kv.block_manager import BlockManager
    from pdserve.engine.kv.cache import KVLayout
    from pdserve.engine.kv.groups import groups_for
    from pdserve.engine.kv.kv_manager import KVCacheManager

    kinds = ("sliding 8", "full", "sliding 8", "full")
    layout = KVLayout(4, 4, 2, 8, "float32", layer_kinds=kinds)
    d = node("d", kv_layout=layout.to_dict())
    # 40 tokens: the full group's 10 blocks, the window's last 8 tokens in blocks 8 and 9.
    assert d.blocks_for(40) == 10 + 2
    assert early_blocks(d, 40) == d.blocks_for(41) == 11 + 3  # and the first token
    assert node("uniform").blocks_for(40) == 10  # every layer full: one group
    manager = KVCacheManager(BlockManager(100, 4), groups_for(4, kinds))
    assert all(d.blocks_for(n) == manager.handoff_size(n) for n in range(1, 60))
    # Layers of two page shapes (Gemma 4's): the groups the node's pool has, lanes and all.
    kinds = ("sliding 8",) * 5 + ("full",) + ("sliding 8",) * 5 + ("full",)
    shapes = (((2, 8),) * 5 + ((1, 32),)) * 2
    layout = KVLayout(12, 4, 1, 32, "float32", layer_kinds=kinds, layer_shapes=shapes)
    d = node("d", kv_layout=layout.to_dict())
    manager = KVCacheManager(BlockManager(100, 4), layout.groups)
    assert d.kv_groups == layout.groups and d.kv_groups != groups_for(12, kinds)
    assert all(d.blocks_for(n) == manager.handoff_size(n) for n in range(1, 60))


def test_an_idle_node_takes_a_sequence_bigger_than_its_headroom():
    queue = AdmissionQueue()
    d = node("d", free=100, total=100)
    queue.push(Candidate("big", 98))
    assert [c.request_id for c, _ in queue.admit([d], watermark=0.1)] == ["big"]


def test_registry_marks_silent_nodes_dead():
    registry = NodeRegistry()
    reg = Register("d0", NodeRole.DECODE, "m", 4, 64, 512, "tcp")
    registry.register(reg, b"d0", now=1000.0)
    registry.heartbeat(Heartbeat("d0", 60, 64, 1, 0, 0), now=1010.0)
    assert registry.nodes["d0"].free_blocks == 60
    assert registry.expire(timeout_s=60, now=1069.0) == []
    assert [n.node_id for n in registry.expire(timeout_s=60, now=1071.0)] == ["d0"]
    assert registry.decode_nodes() == []


def test_the_registry_counts_alive_nodes_of_every_role():
    registry = NodeRegistry()
    for node_id, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        reg = Register(node_id, NodeRole(role), "m", 4, 64, 512, "tcp")
        registry.register(reg, node_id.encode(), now=0.0)
    assert registry.count_by_role() == {"prefill": 1, "decode": 2, "colocated": 0}
    registry.heartbeat(Heartbeat("d0", 60, 64, 0, 0, 0), now=2.0)  # the others fall silent
    assert {n.node_id for n in registry.expire(timeout_s=3, now=4.0)} == {"p0", "d1"}
    assert registry.count_by_role() == {"prefill": 0, "decode": 1, "colocated": 0}


def _registry_with(node_id: str = "d0") -> NodeRegistry:
    registry = NodeRegistry()
    registry.register(Register(node_id, NodeRole.DECODE, "m", 4, 64, 512, "tcp"), b"d0", 0.0)
    return registry


def test_a_resent_load_snapshot_keeps_the_reservations_made_since():
    registry = _registry_with()
    registry.heartbeat(Heartbeat("d0", 60, 64, 1, 0, 0, seq=1), now=1.0)
    node = registry.nodes["d0"]
    node.reserved_blocks = 10  # admitted since that report
    registry.heartbeat(Heartbeat("d0", 60, 64, 1, 0, 0, seq=1), now=2.0)  # the node is mid-step
    assert node.reserved_blocks == 10 and node.available_blocks == 50
    registry.heartbeat(Heartbeat("d0", 50, 64, 2, 0, 0, seq=2), now=3.0)  # a fresh snapshot
    assert node.reserved_blocks == 0 and node.available_blocks == 50


def test_a_stalled_coordinator_does_not_count_its_own_silence_against_nodes():
    registry = _registry_with()  # last heard of at 0
    registry.connection_closed(b"d0", now=0.0)
    registry.forgive(9.5)  # 10 s on, 9.5 of which the coordinator was not listening
    assert registry.expire(timeout_s=3, now=10.0) == []
    assert registry.connection_checks(now=9.9, grace_s=0.5) == []  # nor had it time to reconnect
    assert [n.node_id for n in registry.connection_checks(now=10.0, grace_s=0.5)] == ["d0"]
    assert [n.node_id for n in registry.expire(timeout_s=3, now=15.0)] == ["d0"]
