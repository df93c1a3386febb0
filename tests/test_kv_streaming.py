"""Layer-wise KV streaming, each part alone: the prefill side's per-layer sends (during the real
forward of a prompt's last chunk, and under any order of route, layers and the prefill's end),
the decode side's wait for every layer and the first token, and the coordinator's early
admission with its failure handling."""

from __future__ import annotations

import time

import pytest
import torch
from test_coordinator_core import BLOCK, PROMPT, cluster

from pdserve.cluster.handoff_state import HandoffState
from pdserve.cluster.node_messages import (
    Abort,
    Admit,
    Admitted,
    FinishReason,
    FirstToken,
    HandoffReady,
    Prefill,
    SendKV,
    StartDecode,
    TokenItem,
    Tokens,
    TransferDone,
)
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.request_state import EarlyAdmission, Phase
from pdserve.decode_node.handoff import DecodeHandoff
from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.base import KVSend, KVSender, TransferResult
from pdserve.prefill_node.handoff import PrefillHandoff
from pdserve.prefill_node.layer_stream import LayerStream

LAYOUT = KVLayout(num_layers=4, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
INFO = {"transport": "fake"}


class RecordingSender(KVSender):
    """Records each send with the pages of its layers as they are at the call; acks on poll."""

    name = "fake"

    def __init__(self, pool: KVPool | None) -> None:
        self.pool = pool
        self.sends: list[tuple[str, tuple[int, int], list[int]]] = []
        self.snapshots: list[torch.Tensor] = []  # the whole pool's pages of those blocks
        self.results: list[TransferResult] = []

    def connect(self, peer_id: str, receiver_info: dict) -> None:
        pass

    def send(self, send: KVSend) -> None:
        num_layers = self.pool.layout.num_layers if self.pool else LAYOUT.num_layers
        layers = send.layers or (0, num_layers)
        self.sends.append((send.transfer_id, tuple(layers), list(send.src_blocks)))
        if self.pool is not None:
            self.snapshots.append(self.pool.kv[:, :, list(send.src_blocks)].clone())

    def ack_all(self, ok: bool = True, error: str | None = None) -> None:
        self.results += [TransferResult(t, ok, error, layers) for t, layers, _ in self.sends]
        self.sends = []

    def poll(self) -> list[TransferResult]:
        out, self.results = self.results, []
        return out

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def prefill_side(num_blocks: int = 32) -> tuple[PrefillHandoff, RecordingSender, BlockManager]:
    blocks = BlockManager(num_blocks, LAYOUT.block_size)
    sender = RecordingSender(None)
    handoff = PrefillHandoff(blocks, None, "fake", lambda _t, _p: sender, LAYOUT.num_layers)
    return handoff, sender, blocks


def engine_blocks(blocks: BlockManager, num_tokens: int) -> list[int]:
    table: list[int] = []
    assert blocks.allocate_slots(table, num_tokens)
    return table


# --- the prefill side ------------------------------------------------------------------------


def test_each_layer_leaves_during_the_last_chunks_forward_with_its_final_pages():
    ensure_tiny_model()
    # 40 tokens in chunks of 16: three steps, only the last one's forward sends.
    engine = LLMEngine(num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, device="cpu")
    sender = RecordingSender(engine.pool)
    handoff = PrefillHandoff(engine.block_manager, engine.pool, "fake", lambda _t, _p: sender)
    stream = LayerStream(handoff, engine.scheduler.kv)
    engine.on_schedule = stream.begin
    engine.runner.add_layer_hook(stream.layer_done)
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("r1", list(range(10, 50)), params, prefill_only=True)
    handoff.expect_stream("r1")
    handoff.send("r1", "d0", INFO, list(range(5)), 10.0)  # the route comes before the end
    outputs = []
    for step in range(3):
        assert sender.sends == [], f"step {step} sent before the last chunk"
        outputs = engine.step()
    (out,) = outputs
    num_layers = engine.layout.num_layers
    assert [s[1] for s in sender.sends] == [(i, i + 1) for i in range(num_layers)]
    assert all(s[2] == out.held_tables[0] for s in sender.sends)  # every chunk's blocks
    final = engine.pool.kv[:, :, out.held_tables[0]]
    for layer, snap in enumerate(sender.snapshots):
        # Handed over with that layer final, while the next layer was still to be computed.
        assert torch.equal(snap[layer], final[layer])
        if layer + 1 < num_layers:
            assert not torch.equal(snap[layer + 1], final[layer + 1])
    handoff.hold("r1", out.held_tables)
    assert len(sender.sends) == num_layers  # nothing left to send at the end
    sender.ack_all()
    (end,) = handoff.poll()
    assert end.ok and not handoff.holds("r1")
    assert engine.block_manager.num_used_blocks == 0


def test_a_route_that_comes_mid_forward_sends_the_finished_layers_in_one_send():
    handoff, sender, blocks = prefill_side()
    table = engine_blocks(blocks, 10)
    handoff.expect_stream("r1")
    handoff.layer_done("r1", [table], 0)  # no route yet: nothing leaves
    handoff.layer_done("r1", [table], 1)
    assert sender.sends == []
    handoff.send("r1", "d0", INFO, [7, 8, 9], 10.0)
    handoff.layer_done("r1", [table], 2)
    handoff.layer_done("r1", [table], 3)
    assert [s[1] for s in sender.sends] == [(0, 3), (3, 4)]
    handoff.hold("r1", [table])  # the engine's references pass; the handoff keeps its own
    assert handoff.poll() == []  # the sends have not ended
    assert blocks.num_used_blocks == 3
    sender.ack_all()
    assert [e.ok for e in handoff.poll()] == [True] and blocks.num_used_blocks == 0


def test_a_route_after_the_prefill_sends_every_layer_at_once():
    handoff, sender, blocks = prefill_side()
    table = engine_blocks(blocks, 10)
    handoff.expect_stream("r1")
    for layer in range(LAYOUT.num_layers):
        handoff.layer_done("r1", [table], layer)
    handoff.hold("r1", [table])
    assert handoff.handoffs["r1"].state is HandoffState.HELD and sender.sends == []
    handoff.send("r1", "d0", INFO, [7, 8, 9], 10.0)
    assert [s[1] for s in sender.sends] == [(0, LAYOUT.num_layers)]
    sender.ack_all()
    assert [e.ok for e in handoff.poll()] == [True] and blocks.num_used_blocks == 0


def test_a_first_token_that_ends_the_request_frees_the_blocks_once_the_sends_end():
    handoff, sender, blocks = prefill_side()
    table = engine_blocks(blocks, 10)
    handoff.expect_stream("r1")
    handoff.send("r1", "d0", INFO, [7, 8, 9], 10.0)
    for layer in range(LAYOUT.num_layers):
        handoff.layer_done("r1", [table], layer)
    blocks.free(list(table))  # the engine finished the sequence (EOS) and freed its refs
    assert handoff.abort("r1")  # the node: its sends are not needed
    assert blocks.num_used_blocks == 3  # still read by the sends in flight
    assert handoff.poll() == []
    sender.ack_all()
    (end,) = handoff.poll()
    assert not end.ok and blocks.num_used_blocks == 0


def test_a_failed_layer_stops_the_rest_and_the_handoff_fails_once():
    handoff, sender, blocks = prefill_side()
    table = engine_blocks(blocks, 10)
    handoff.expect_stream("r1")
    handoff.send("r1", "d0", INFO, [7, 8, 9], 10.0)
    handoff.layer_done("r1", [table], 0)
    sender.ack_all(ok=False, error="receiver gone")
    # The failure is seen at the next poll, after the step: here the remaining layers were
    # already handed over, so they end too before the handoff does.
    handoff.layer_done("r1", [table], 1)
    handoff.hold("r1", [table])
    ends = handoff.poll()
    assert ends == []  # layers 1.. still in flight
    sender.ack_all()
    (end,) = handoff.poll()
    assert not end.ok and end.error == "receiver gone" and blocks.num_used_blocks == 0


def test_streamed_layers_skip_the_blocks_the_decode_node_holds():
    # Prefix reuse with streaming: the decode node holds the first two blocks; each layer's
    # send carries only the third.
    handoff, sender, blocks = prefill_side()
    table = engine_blocks(blocks, 10)
    handoff.expect_stream("r1")
    handoff.send("r1", "d0", INFO, [9], 10.0, skip_blocks=2, prefilling=True)
    for layer in range(LAYOUT.num_layers):
        handoff.layer_done("r1", [table], layer)
    handoff.hold("r1", [table])
    assert [s[2] for s in sender.sends] == [table[2:]] * LAYOUT.num_layers
    sender.ack_all()
    assert [e.ok for e in handoff.poll()] == [True] and blocks.num_used_blocks == 0


def test_a_streamed_send_whose_skip_does_not_match_the_destination_fails_once_and_frees():
    handoff, sender, blocks = prefill_side()
    table = engine_blocks(blocks, 10)  # 3 blocks
    handoff.expect_stream("r1")
    handoff.send("r1", "d0", INFO, [8, 9], 10.0, skip_blocks=2)  # 1 block left, 2 expected
    for layer in range(LAYOUT.num_layers):
        handoff.layer_done("r1", [table], layer)
    handoff.hold("r1", [table])
    assert sender.sends == []
    (end,) = handoff.poll()
    assert not end.ok and "2 skipped" in end.error and blocks.num_used_blocks == 0


def test_an_abort_before_any_send_leaves_the_blocks_to_the_engine():
    handoff, sender, blocks = prefill_side()
    handoff.expect_stream("r1")
    handoff.send("r1", "d0", INFO, [7, 8, 9], 10.0)
    assert not handoff.abort("r1")  # the engine's abort frees the prompt's blocks
    assert not handoff.holds("r1") and handoff.poll() == [] and sender.sends == []


# --- the decode side -------------------------------------------------------------------------


class Decode:
    """A real tcp receiver and a real sender of a pool of our own, for partial layer ranges."""

    def __init__(self) -> None:
        self.receiver = make_receiver("tcp", LAYOUT, 16)
        self.blocks = BlockManager(16, LAYOUT.block_size)
        self.handoff = DecodeHandoff(self.receiver, self.blocks)
        self.src = KVPool(LAYOUT, 16)
        self.src.kv.copy_(torch.randn_like(self.src.kv))
        self.sender = make_sender("tcp", self.src)
        self.sender.connect("d0", self.receiver.info())

    def admit_early(self, request_id: str, num_tokens: int = 10) -> tuple[Sequence, list[int]]:
        seq = Sequence(request_id, list(range(num_tokens)), SamplingParams(max_tokens=4))
        seq.num_computed_tokens = num_tokens
        return seq, self.handoff.reserve(seq, 10.0, first_token_pending=True)

    def poll_until(self, done, timeout_s: float = 20.0):  # noqa: ANN001, ANN201
        deadline = time.monotonic() + timeout_s
        arrived, failed = [], []
        while time.monotonic() < deadline:
            a, f = self.handoff.poll()
            arrived += a
            failed += f
            self.sender.poll()
            if done(arrived, failed):
                return arrived, failed
            time.sleep(0.01)
        raise AssertionError(f"not done: {arrived} {failed}")

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def decode():
    d = Decode()
    yield d
    d.close()


def test_a_send_kv_that_overtakes_its_prefill_order_is_kept_for_it():
    handoff, sender, blocks = prefill_side()
    handoff.send("r1", "d0", INFO, [7, 8, 9], 10.0, prefilling=True)  # the handoff socket
    assert handoff.poll() == []  # not refused
    handoff.expect_stream("r1")  # the loop takes the Prefill order
    table = engine_blocks(blocks, 10)
    handoff.layer_done("r1", [table], 0)
    assert [s[1] for s in sender.sends] == [(0, 1)]
    # A late order for KV no prefill here will produce is still refused.
    handoff.send("r2", "d0", INFO, [1], 10.0)
    assert [(e.request_id, e.ok) for e in handoff.poll()] == [("r2", False)]
    # An abort forgets a route kept ahead of its prefill.
    handoff.send("r3", "d0", INFO, [1], 10.0, prefilling=True)
    handoff.abort("r3")
    handoff.expect_stream("r3")
    assert handoff.handoffs["r3"].route is None


@pytest.mark.parametrize("token_first", [True, False])
def test_the_sequence_starts_only_with_every_layer_and_its_first_token(decode, token_first):
    seq, dst = decode.admit_early("r1")
    src = [0, 1, 2]
    if token_first:
        assert decode.handoff.start("r1", 99) is None  # KV not in yet
    decode.sender.send(KVSend("r1", "d0", src, dst, layers=(0, 1)))
    time.sleep(0.2)
    assert decode.handoff.poll() == ([], [])  # layer 0 alone does not complete it
    decode.sender.send(KVSend("r1", "d0", src, dst, layers=(1, LAYOUT.num_layers)))
    arrived, _ = decode.poll_until(
        lambda a, f: a or decode.handoff.handoffs["r1"].state is HandoffState.ARRIVED
    )
    if token_first:
        assert arrived == [seq]
    else:
        assert arrived == []  # every layer is in, the first token is not
        assert decode.handoff.start("r1", 99) is seq
    assert seq.token_ids == list(range(10)) + [99] and seq.num_computed_tokens == 10
    for s, d in zip(src, dst):
        assert torch.equal(decode.src.kv[:, :, s], decode.receiver.pool.kv[:, :, d])


def test_a_sender_lost_after_some_layers_fails_the_arrival_and_frees_the_reservation(decode):
    seq, dst = decode.admit_early("r1")
    decode.sender.send(KVSend("r1", "d0", [0, 1, 2], dst, layers=(0, 2)))
    time.sleep(0.2)
    decode.sender.close()  # the prefill node dies with half the layers sent
    _, failed = decode.poll_until(lambda a, f: f)
    assert [f.request_id for f in failed] == ["r1"] and decode.blocks.num_used_blocks == 0
    assert decode.handoff.start("r1", 99) is None  # a late first token finds nothing


def test_an_arrived_sequence_cancelled_before_its_token_is_freed_at_once(decode):
    _, dst = decode.admit_early("r1")
    decode.sender.send(KVSend("r1", "d0", [0, 1, 2], dst))
    decode.poll_until(lambda a, f: decode.handoff.handoffs["r1"].state is HandoffState.ARRIVED)
    assert decode.handoff.cancel("r1")
    assert decode.blocks.num_used_blocks == 0 and not decode.handoff.holds("r1")


def test_an_early_admission_with_reuse_expects_only_the_uncached_blocks(decode):
    # A first turn's 8 tokens left two full blocks in the decode node's prefix cache.
    table: list[int] = []
    assert decode.blocks.allocate_slots(table, 8)
    decode.blocks.cache_full_blocks(table, list(range(8)), 8)
    decode.blocks.free(list(table))
    seq = Sequence("r1", list(range(10)), SamplingParams(max_tokens=4))
    seq.num_computed_tokens = 10
    dst = decode.handoff.reserve(seq, 10.0, reuse_prefix=True, first_token_pending=True)
    assert seq.block_table[:2] == table and dst == seq.block_table[2:] and len(dst) == 1
    assert seq.num_cached_tokens == 8 and decode.handoff.blocks_reused == 2
    decode.sender.send(KVSend("r1", "d0", [2], dst, layers=(0, 2)))
    decode.sender.send(KVSend("r1", "d0", [2], dst, layers=(2, LAYOUT.num_layers)))
    decode.poll_until(lambda a, f: decode.handoff.handoffs["r1"].state is HandoffState.ARRIVED)
    assert decode.handoff.blocks_received == 1
    assert decode.handoff.start("r1", 99) is seq
    assert torch.equal(decode.src.kv[:, :, 2], decode.receiver.pool.kv[:, :, dst[0]])


# --- the coordinator ---------------------------------------------------------------------------

LONG = list(range(10, 42))  # 32 tokens: 8 blocks, 9 with the first token's


def streaming(**config: object):  # noqa: ANN201
    config.setdefault("kv_streaming", True)
    config.setdefault("kv_streaming_min_prompt_tokens", 16)
    sim = cluster(**config)
    sim.report("p0/handoff", HandoffReady("p0"))
    return sim


def test_a_long_prompt_is_admitted_when_its_prefill_starts():
    sim = streaming(kv_streaming_timeout_s=77.0)
    state = sim.submit(max_tokens=3, prompt=LONG)
    (prefill,) = sim.sent(Prefill, "p0")
    (admit,) = sim.sent(Admit, "d0")
    assert prefill.stream_kv and admit.first_token_pending
    assert admit.token_ids == LONG and admit.num_computed == len(LONG)
    assert admit.params.max_tokens == 3 and admit.output_offset == 0
    assert admit.transfer_timeout_s == 77.0 and state.phase is Phase.PREFILLING
    assert sim.core.nodes.nodes["d0"].reserved_blocks == -(-(len(LONG) + 1) // BLOCK)
    sim.report("d0", Admitted(admit.request_id, True, list(range(8))))
    (send,) = sim.sent(SendKV, "p0/handoff")  # before the prefill's end
    assert send.dst_blocks == list(range(8)) and state.early is EarlyAdmission.ADMITTED
    assert send.prefilling
    sim.report("p0", FirstToken(prefill.request_id, 50, None, 0, num_blocks=8))
    (start,) = sim.sent(StartDecode, "d0")
    assert (start.request_id, start.token_id) == (admit.request_id, 50)
    assert state.phase is Phase.TRANSFERRING
    sim.report("p0", TransferDone(send.request_id, True))
    sim.report("d0", Tokens("d0", [TokenItem(admit.request_id, 51)]))
    sim.report("d0", Tokens("d0", [TokenItem(admit.request_id, 52, FinishReason.LENGTH)]))
    assert [t for e in sim.events for t in e.token_ids] == [50, 51, 52]
    assert not sim.core.requests and sim.orders == []


def test_a_first_token_before_the_reservation_waits_for_it():
    sim = streaming()
    state = sim.submit(prompt=LONG)
    (prefill,) = sim.sent(Prefill, "p0")
    (admit,) = sim.sent(Admit, "d0")
    sim.report("p0", FirstToken(prefill.request_id, 50, None, 0, num_blocks=8))
    assert state.phase is Phase.ADMITTING and sim.sent(StartDecode) == []
    sim.report("d0", Admitted(admit.request_id, True, list(range(8))))
    assert len(sim.sent(SendKV, "p0/handoff")) == 1
    assert [m.token_id for m in sim.sent(StartDecode, "d0")] == [50]
    assert state.phase is Phase.TRANSFERRING


def test_short_prompts_and_streaming_off_go_the_usual_way():
    for sim, prompt in ((streaming(), PROMPT), (streaming(kv_streaming=False), LONG)):
        sim.submit(prompt=prompt)
        (prefill,) = sim.sent(Prefill, "p0")
        assert not prefill.stream_kv and sim.sent(Admit) == []


def test_a_refused_early_admission_falls_back_to_admission_after_the_first_token():
    sim = streaming()
    state = sim.submit(prompt=LONG)
    (prefill,) = sim.sent(Prefill, "p0")
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, False))
    assert state.early is EarlyAdmission.NONE and state.decode_node is None
    assert sim.sent(SendKV) == []
    sim.heartbeat("d0")
    sim.report("p0", FirstToken(prefill.request_id, 50, None, 0, num_blocks=8))
    (again,) = sim.sent(Admit, "d0")
    assert not again.first_token_pending and again.token_ids == LONG + [50]


def test_an_abort_mid_prefill_frees_the_reservation_at_once_on_both_sides():
    for admitted in (False, True):
        sim = streaming()
        state = sim.submit(prompt=LONG)
        (admit,) = sim.sent(Admit, "d0")
        if admitted:
            sim.report("d0", Admitted(admit.request_id, True, list(range(8))))
            sim.sent(SendKV)
        sim.take(sim.core.abort(state.request_id, sim.now))
        # Before SendKV the decode node frees at once; after it, once no page can land.
        assert [(m.request_id, m.kv_unsent) for m in sim.sent(Abort, "d0")] == [
            (admit.request_id, not admitted)
        ]
        assert [m.request_id for m in sim.sent(Abort, "p0")] == [admit.request_id]
        assert not sim.core.requests


def test_a_first_token_that_ends_the_request_releases_the_early_reservation():
    sim = streaming()
    sim.submit(prompt=LONG)
    (prefill,) = sim.sent(Prefill, "p0")
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, list(range(8))))
    sim.report("p0", FirstToken(prefill.request_id, 2, FinishReason.STOP, 0, num_blocks=0))
    assert [(m.request_id, m.kv_unsent) for m in sim.sent(Abort, "d0")] == [
        (admit.request_id, False)
    ]
    assert sim.events[-1].finish_reason == "stop" and not sim.core.requests


@pytest.mark.parametrize("dead", ["p0", "d0"])
def test_a_node_lost_mid_prefill_after_admission_moves_the_request(dead):
    sim = streaming()
    state = sim.submit(prompt=LONG)
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, list(range(8))))
    sim.sent(SendKV)
    alive = ("p0", "d0")
    sim.tick(4.0, alive=tuple(n for n in alive if n != dead))
    assert state.attempt == 1  # re-dispatched
    survivor = "d0" if dead == "p0" else "p0"
    assert [m.request_id for m in sim.sent(Abort, survivor)] == [admit.request_id]


def test_a_failed_streamed_transfer_during_the_prefill_retries_the_request():
    sim = streaming()
    state = sim.submit(prompt=LONG)
    (admit,) = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(admit.request_id, True, list(range(8))))
    sim.report("d0", TransferDone(admit.request_id, False, "timed out"))
    assert state.attempt == 1 and state.phase is Phase.PREFILLING
