"""The cluster-wide prefix index: a node's KV event stream applied to the coordinator's index holds
exactly what the node holds, whatever happens to its reports on the way; a dead node takes its
entries with it; routing and placement follow what the index says the nodes hold."""

from __future__ import annotations

import random

import pytest
from test_coordinator_core import BLOCK, Sim

from pdserve.cluster.block_hash import group_hash, prefix_hashes
from pdserve.cluster.kv_event_stream import TIERS, KVEventStream, pack_hashes
from pdserve.cluster.node_messages import (
    Admit,
    Generate,
    Heartbeat,
    KVEventRecord,
    KVEventsAck,
    KVOp,
    NodeRole,
    Prefill,
)
from pdserve.coordinator.nodes import NodeState
from pdserve.coordinator.prefix_index import PrefixIndex
from pdserve.coordinator.routing import TierCosts, choose_by_prefix, kv_load, most_free_blocks
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.events import KVEvents

# --- the index and the nodes agree ----------------------------------------------------------


class ChurningNode:
    """A real block manager under random allocations, frees and evictions, logging into the
    node's KV events, with made-up host and disk tiers logging beside it."""

    def __init__(self, rng: random.Random, num_blocks: int = 48, block_size: int = 4) -> None:
        self.rng = rng
        self.events = KVEvents()
        self.bm = BlockManager(num_blocks, block_size, events=self.events)
        self.lower: dict[str, set[int]] = {"host": set(), "disk": set()}
        self.tables: list[list[int]] = []
        # A few shared stems so that prompts hit cached prefixes and blocks are evicted.
        self.stems = [[rng.randrange(50) for _ in range(12)] for _ in range(6)]

    def step(self) -> None:
        rng, bm = self.rng, self.bm
        r = rng.random()
        if r < 0.45:
            prompt = rng.choice(self.stems) + [rng.randrange(50) for _ in range(rng.randrange(13))]
            table = bm.allocate_prefix(prompt)
            if bm.allocate_slots(table, len(prompt)):
                bm.cache_full_blocks(table, prompt, len(prompt))
                self.tables.append(table)
            else:
                bm.free(table)
        elif r < 0.8 and self.tables:
            bm.free(self.tables.pop(rng.randrange(len(self.tables))))
        elif r < 0.82:
            bm.reset_prefix_cache()
        else:  # the tiers below the pool take a copy of a device block, or drop one
            tier = rng.choice(("host", "disk"))
            held = self.lower[tier]
            if held and rng.random() < 0.4:
                h = rng.choice(sorted(held))
                held.discard(h)
                self.events.removed(tier, h)
            elif bm._cached:
                h = rng.choice(sorted(bm._cached))
                if h not in held:
                    held.add(h)
                    self.events.stored(tier, h)

    def truth(self) -> dict[str, set[int]]:
        return {"device": set(self.bm._cached), **{t: set(h) for t, h in self.lower.items()}}


class LossyNet:
    """Load reports lost, repeated and reordered on the way; acknowledgements (orders, in the
    link's ordered session) delayed but in order."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.reports: list[Heartbeat] = []
        self.acks: list[KVEventsAck] = []

    def send_report(self, beat: Heartbeat) -> None:
        if self.rng.random() < 0.25:
            return  # lost
        self.reports.append(beat)
        if self.rng.random() < 0.2:
            self.reports.append(beat)  # repeated

    def deliver(self, index: PrefixIndex, stream: KVEventStream) -> None:
        self.rng.shuffle(self.reports)
        while self.reports and self.rng.random() < 0.7:
            beat = self.reports.pop()
            ack = index.apply(beat.node_id, beat.kv_stream, beat.kv_events)
            if ack is not None:
                self.acks.append(ack)
        while self.acks and self.rng.random() < 0.6:
            stream.acknowledged(self.acks.pop(0))


def report(stream: KVEventStream, node_id: str = "n0") -> Heartbeat:
    beat = Heartbeat(node_id, 0, 0, 0, 0, 0)
    beat.kv_stream, beat.kv_events = stream.report()
    return beat


def settle(index: PrefixIndex, stream: KVEventStream, node_id: str = "n0") -> None:
    """Reports and acknowledgements with nothing lost, until the node's log is acknowledged."""
    for _ in range(10_000):
        if not stream.log:
            return
        ack = index.apply(node_id, *stream.report())
        if ack is not None:
            stream.acknowledged(ack)
    raise AssertionError("the node's KV event log never emptied")


@pytest.mark.parametrize("seed", range(3))
def test_the_index_holds_what_the_node_holds_after_churn_and_lossy_reports(seed):
    rng = random.Random(seed)
    node = ChurningNode(rng)
    stream = KVEventStream(node.events, max_report_hashes=40)  # small: reports fill up
    index, net = PrefixIndex(), LossyNet(rng)
    index.register("n0", stream.restart())
    for i in range(12_000):
        node.step()
        if i % 7 == 0:
            beat = report(stream)
            assert sum(len(r.hashes) // 16 for r in beat.kv_events) <= 40  # a report's cap
            net.send_report(beat)
        if i % 5 == 0:
            net.deliver(index, stream)
        if i % 5000 == 4999:  # the node registers again (a reset): a new stream, a snapshot
            net.reports.clear()  # the new stream's records only
            index.register("n0", stream.restart())
    net.reports.clear()
    net.acks.clear()
    settle(index, stream)
    truth = node.truth()
    assert truth["device"] and truth["host"] and truth["disk"]
    for tier in TIERS:
        assert stream.held[tier] == truth[tier], tier
        assert index.held("n0", tier) == truth[tier], tier


def test_a_record_that_never_came_makes_the_index_ask_for_a_snapshot():
    events = KVEvents()
    stream = KVEventStream(events)
    index = PrefixIndex()
    index.register("n0", stream.restart())
    for h in range(1, 6):
        events.stored("device", h)
        stream.report()  # each event its own record
    events.removed("device", 2)
    events.stored("host", 7)
    _, records = stream.report()
    ack = index.apply("n0", stream.stream, records[:2] + records[3:])  # one lost for good
    assert ack is not None and ack.resync and ack.seq == records[1].seq
    stream.acknowledged(ack)
    assert stream.log[0].op is KVOp.CLEAR  # the answer: a snapshot
    settle(index, stream)
    assert index.held("n0", "device") == {1, 3, 4, 5} and index.held("n0", "host") == {7}


def test_a_report_of_another_stream_is_not_applied():
    index = PrefixIndex()
    index.register("n0", 5)
    old = [KVEventRecord(1, KVOp.CLEAR), KVEventRecord(2, KVOp.STORED, "device", pack_hashes([9]))]
    assert index.apply("n0", 4, old) is None  # a report of the node's previous incarnation
    assert not index.held("n0", "device")
    ack = index.apply("n0", 5, old)
    assert ack == KVEventsAck(5, 2) and index.held("n0", "device") == {9}


def test_an_unacknowledged_log_is_bounded_by_a_snapshot():
    events = KVEvents()
    stream = KVEventStream(events, max_report_hashes=16)
    stream.restart()
    for i in range(2000):  # the same few blocks in and out: nobody acknowledges
        (events.stored if i % 2 == 0 else events.removed)("device", i % 8)
        stream.report()
    assert stream.log_hashes <= 4 * 16 + 16


# --- a node that dies takes its entries with it -------------------------------------------


def test_a_dead_or_reregistered_node_takes_its_index_entries_with_it():
    sim = Sim()
    sim.register("p0", NodeRole.PREFILL)
    sim.register("d0", NodeRole.DECODE)
    sim.register("d1", NodeRole.DECODE)
    prompt = list(range(100, 132))
    for node_id in ("p0", "d0", "d1"):
        sim.cache(node_id, prompt)
    index = sim.core.prefix_index
    assert index.blocks_by_tier()["device"] == 3 * 8
    sim.take(sim.core.declare_dead("d0", sim.now))
    assert not index.held("d0", "device")
    sim.tick(3.5, alive=("p0",))  # d1 goes silent past the heartbeat timeout
    assert not index.held("d1", "device")
    assert index.blocks_by_tier() == {"device": 8, "host": 0, "disk": 0}
    sim.register("p0", NodeRole.PREFILL)  # a new process under the same id
    assert index.blocks_by_tier() == {"device": 0, "host": 0, "disk": 0}


# --- routing ------------------------------------------------------------------------------


def node(node_id: str, free: int = 100, **kw: object) -> NodeState:
    return NodeState(node_id, NodeRole.DECODE, node_id.encode(), 100, BLOCK, 512, "tcp", {}, {},
                     free_blocks=free, **kw)  # fmt: skip


def holding(holdings: dict[str, dict[str, list[int]]]) -> PrefixIndex:
    """An index whose nodes hold the full blocks of the given token lists, by tier."""
    index = PrefixIndex()
    for node_id, tiers in holdings.items():
        index.register(node_id, 1)
        records = [KVEventRecord(1, KVOp.CLEAR)]
        for tier, tokens in tiers.items():
            hashes = pack_hashes(prefix_hashes(tokens, BLOCK))
            records.append(KVEventRecord(len(records) + 1, KVOp.STORED, tier, hashes))
        index.apply(node_id, 1, records)
    return index


PROMPT = list(range(200, 240))  # 10 blocks


def choose(index: PrefixIndex, nodes: list[NodeState], costs: TierCosts | None = None):
    costs = costs or TierCosts()
    return choose_by_prefix(index, PROMPT, nodes, 1, 2.0, costs, kv_load, most_free_blocks)


def test_the_node_holding_the_longest_prefix_in_any_tier_is_chosen():
    a, b, c = node("a", free=95), node("b", free=95), node("c", free=100)  # c: most free
    index = holding(
        {"a": {"device": PROMPT[:16]}, "b": {"device": PROMPT[:8], "host": PROMPT[:32]}}
    )
    choice = choose(index, [a, b, c], TierCosts(host=0.0))
    assert choice.node is b and choice.match.blocks == 8
    assert choice.match.by_tier == {"device": 2, "host": 6, "disk": 0}
    assert choose(PrefixIndex(), [a, b, c]).node is c  # nothing held: the fallback's choice


def test_tiers_are_weighted_by_their_loading_cost():
    a, b = node("a"), node("b")
    index = holding({"a": {"device": PROMPT[:12]}, "b": {"disk": PROMPT[:20]}})  # 3 vs 5 blocks
    assert choose(index, [a, b], TierCosts(disk=0.5)).node is a  # 3 blocks against 2.5 saved
    assert choose(index, [a, b], TierCosts(disk=0.2)).node is b  # 3 against 4
    index = holding({"a": {"device": PROMPT[:12]}, "b": {"host": PROMPT[:16]}})
    assert choose(index, [a, b], TierCosts(host=0.1)).node is b  # 3 against 3.6


def test_a_node_of_windowed_layers_holds_a_prefix_only_where_every_group_holds_its_window():
    # Layer 1 full (group 0), layer 0 an 8-token window (group 1, its blocks under salted keys).
    layout = {"num_layers": 2, "layer_kinds": ["sliding 8", "full"]}
    a, b = node("a"), node("b")
    a.kv_layout = b.kv_layout = layout
    hashes = prefix_hashes(PROMPT, BLOCK)  # 10 blocks
    window = [group_hash(h, 1) for h in hashes]
    index = PrefixIndex()
    for node_id, host in (("a", window[7:9]), ("b", window[6:8])):
        index.register(node_id, 1)
        index.apply(node_id, 1, [
            KVEventRecord(1, KVOp.CLEAR),
            KVEventRecord(2, KVOp.STORED, "device", pack_hashes(hashes)),
            KVEventRecord(3, KVOp.STORED, "host", pack_hashes(host)),
        ])  # fmt: skip
    # Group 0's run alone says 10 blocks. The query after 10 reads tokens 33..40, blocks 8 and
    # 9, of which a's window holds only 8; after 9 it reads 29..36, blocks 7 and 8: held (host).
    assert index.match("a", hashes).blocks == 10
    match = index.match("a", hashes, a.kv_groups, BLOCK)
    assert match.blocks == 9 and match.by_tier == {"device": 7, "host": 2, "disk": 0}
    # b's window holds blocks 6 and 7: the hit after 8 blocks (tokens 25..32).
    assert index.match("b", hashes, b.kv_groups, BLOCK).blocks == 8
    assert choose(index, [b, a], TierCosts(host=0.0)).node is a
    a.kv_layout = b.kv_layout = {"num_layers": 2}  # every layer full: the run
    assert index.match("b", hashes, b.kv_groups, BLOCK).blocks == 10


def test_the_holder_yields_to_the_fallback_when_much_more_loaded():
    a, b = node("a", free=100), node("b", free=100)
    index = holding({"a": {"device": PROMPT[:16]}})  # 16 tokens saved
    assert choose(index, [a, b]).node is a
    a.free_blocks = 96  # 16 tokens of KV held: within 2 x 0 + 16
    assert choose(index, [a, b]).node is a
    a.free_blocks = 95  # 20 tokens: over the rule's slack
    assert choose(index, [a, b]).node is b


# --- placement by uncached tokens --------------------------------------------------------


def test_a_mostly_cached_long_prompt_is_prefilled_where_it_is_cached_an_uncached_one_is_not():
    sim = Sim(local_prefill_max_uncached_tokens=8, kv_streaming=False)
    sim.register("p0", NodeRole.PREFILL, num_blocks=256)
    sim.register("d0", NodeRole.DECODE, num_blocks=256)
    sim.register("d1", NodeRole.DECODE, num_blocks=256)
    turn1 = list(range(1000, 1160))  # 160 tokens: 40 blocks
    sim.cache("d1", turn1)
    sim.submit(max_tokens=2, prompt=turn1 + [5, 6, 7, 8, 9, 10])  # 96 % cached on d1
    (generate,) = sim.sent(Generate, "d1")
    assert not sim.sent(Prefill) and not sim.sent(Admit)
    sim.submit(max_tokens=2, prompt=list(range(2000, 2166)))  # the same length, uncached
    assert sim.sent(Prefill, "p0") and not sim.sent(Generate)
    # Too many tokens left to compute on the holder: disaggregated.
    sim.submit(max_tokens=2, prompt=turn1[:100] + list(range(3000, 3066)))
    assert sim.sent(Prefill, "p0") and not sim.sent(Generate)


def test_placement_by_uncached_tokens_is_off_at_zero():
    sim = Sim(kv_streaming=False)
    sim.register("p0", NodeRole.PREFILL, num_blocks=256)
    sim.register("d0", NodeRole.DECODE, num_blocks=256)
    turn1 = list(range(1000, 1160))
    sim.cache("d0", turn1)
    sim.submit(max_tokens=2, prompt=turn1 + [5, 6, 7, 8])
    assert sim.sent(Prefill, "p0") and not sim.sent(Generate)
