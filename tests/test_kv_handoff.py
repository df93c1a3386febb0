"""The KV handoff component on both sides, alone: real tcp transports in one process, block
managers and pools of their own. Every handoff ends with its blocks freed exactly once, and only
once no transport can touch them any more."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.cluster.handoff_state import HandoffState
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.decode_node.handoff import DecodeHandoff
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import make_receiver
from pdserve.prefill_node.handoff import PrefillHandoff

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
BLOCKS = 16


class Sides:
    def __init__(self) -> None:
        self.src_blocks = BlockManager(BLOCKS, LAYOUT.block_size)
        self.src_pool = KVPool(LAYOUT, BLOCKS)
        self.src_pool.kv.copy_(torch.randn_like(self.src_pool.kv))
        self.receiver = make_receiver("tcp", LAYOUT, BLOCKS)
        self.dst_blocks = BlockManager(BLOCKS, LAYOUT.block_size)
        self.prefill = PrefillHandoff(self.src_blocks, self.src_pool, "tcp")
        self.decode = DecodeHandoff(self.receiver, self.dst_blocks)

    def prefilled(self, request_id: str, num_tokens: int = 10) -> list[int]:
        """A prefill-only sequence's blocks, held for its handoff."""
        blocks: list[int] = []
        assert self.src_blocks.allocate_slots(blocks, num_tokens) is not False
        self.prefill.hold(request_id, [blocks])
        return list(blocks)

    def incoming(self, request_id: str, num_tokens: int = 10, timeout_s: float = 10.0):  # noqa: ANN201
        params = SamplingParams(max_tokens=4, temperature=0)
        seq = Sequence(request_id, list(range(num_tokens)), params)
        seq.token_ids.append(99)
        seq.num_computed_tokens = num_tokens
        return seq, self.decode.reserve(seq, timeout_s)

    def run_until(self, done, timeout_s: float = 20.0):  # noqa: ANN001, ANN201
        deadline = time.monotonic() + timeout_s
        prefill_ends, arrived, failed = [], [], []
        while time.monotonic() < deadline:
            prefill_ends += self.prefill.poll()
            a, f = self.decode.poll()
            arrived += a
            failed += f
            if done(prefill_ends, arrived, failed):
                return prefill_ends, arrived, failed
            time.sleep(0.01)
        raise AssertionError(f"not done: {prefill_ends} {arrived} {failed}")

    def close(self) -> None:
        self.prefill.close()
        self.receiver.close()


@pytest.fixture
def sides():
    s = Sides()
    yield s
    s.close()


def test_a_handoff_lands_the_pages_and_frees_the_prefill_side_once_sent(sides):
    src = sides.prefilled("r1")
    seq, dst = sides.incoming("r1")
    assert len(dst) == len(src) == 3 and seq.block_table == dst
    sides.prefill.send("r1", "d0", sides.receiver.info(), dst, timeout_s=10)
    ends, arrived, _ = sides.run_until(lambda e, a, f: e and a)
    assert [(e.request_id, e.ok) for e in ends] == [("r1", True)] and arrived == [seq]
    for s, d in zip(src, dst):
        assert torch.equal(sides.src_pool.kv[:, :, s], sides.receiver.pool.kv[:, :, d])
    assert sides.src_blocks.num_free_blocks == BLOCKS  # the prefill side let go
    assert sides.dst_blocks.num_free_blocks == BLOCKS - 3  # the sequence holds its KV now
    assert sides.prefill.num_pending == 0 and sides.decode.num_pending == 0


def test_an_abort_while_sending_frees_the_blocks_only_once_the_send_ends(sides):
    sides.prefilled("r1")
    _, dst = sides.incoming("r1")
    sides.prefill.send("r1", "d0", sides.receiver.info(), dst, timeout_s=10)
    assert sides.prefill.abort("r1")
    assert sides.prefill.handoffs["r1"].state is HandoffState.CANCELLED
    assert sides.src_blocks.num_free_blocks == BLOCKS - 3  # the sender may still read them
    sides.run_until(lambda e, a, f: e)
    assert sides.src_blocks.num_free_blocks == BLOCKS and sides.prefill.num_pending == 0


def test_an_abort_of_held_kv_frees_it_at_once(sides):
    sides.prefilled("r1")
    assert sides.prefill.abort("r1") and sides.src_blocks.num_free_blocks == BLOCKS
    assert not sides.prefill.abort("r1")  # said twice: nothing held any more
    assert sides.prefill.poll() == []


def test_an_order_for_kv_not_held_here_frees_nothing(sides):
    sides.prefilled("r1")
    _, dst = sides.incoming("r1")
    info = sides.receiver.info()
    sides.prefill.send("r1", "d0", info, dst, timeout_s=10)
    sides.prefill.send("r1", "d0", info, dst, timeout_s=10)  # the same order again
    sides.prefill.send("nobody", "d0", info, dst, timeout_s=10)
    ends, arrived, _ = sides.run_until(lambda e, a, f: len(e) == 3 and a)
    refused = sorted((e.request_id, e.error) for e in ends if not e.ok)
    assert refused == [("nobody", "no prefilled KV held here"), ("r1", "no prefilled KV held here")]
    assert [e.request_id for e in ends if e.ok] == ["r1"]
    assert sides.src_blocks.num_free_blocks == BLOCKS  # freed once, by the send that ran


def test_a_send_that_cannot_start_frees_its_blocks_at_the_next_poll(sides):
    sides.prefilled("r1")
    _, dst = sides.incoming("r1")
    sides.prefill.send("r1", "d0", {**sides.receiver.info(), "protocol": -1}, dst, timeout_s=10)
    assert sides.src_blocks.num_free_blocks == BLOCKS - 3  # only the loop frees blocks
    (end,) = sides.prefill.poll()
    assert not end.ok and "protocol mismatch" in end.error
    assert sides.src_blocks.num_free_blocks == BLOCKS and sides.prefill.num_pending == 0


def test_a_reservation_the_pool_cannot_hold_takes_nothing(sides):
    _, dst = sides.incoming("big", num_tokens=BLOCKS * LAYOUT.block_size + 1)
    assert dst is None and sides.dst_blocks.num_free_blocks == BLOCKS
    assert sides.decode.num_pending == 0


def test_an_unsent_reservation_is_freed_at_once_and_a_maybe_sent_one_once_the_receiver_stops(
    sides,
):
    _, dst = sides.incoming("unsent")
    assert sides.decode.cancel("unsent", kv_unsent=True)
    assert sides.dst_blocks.num_free_blocks == BLOCKS and sides.decode.num_pending == 0
    # Without the mark a sender may be writing: the blocks wait until the receiver has stopped
    # the transfer (not until its timeout, an hour here).
    _, dst = sides.incoming("maybe", timeout_s=3600)
    assert sides.decode.cancel("maybe")
    assert sides.dst_blocks.num_free_blocks == BLOCKS - 3
    _, arrived, failed = sides.run_until(lambda e, a, f: sides.decode.num_pending == 0)
    assert arrived == [] and failed == []  # the coordinator asked for it: nothing to report
    assert sides.dst_blocks.num_free_blocks == BLOCKS


def test_kv_of_a_cancelled_reservation_never_starts_a_sequence(sides):
    sides.prefilled("r1")
    seq, dst = sides.incoming("r1")
    sides.decode.cancel("r1")  # aborted while the sender writes
    sides.prefill.send("r1", "d0", sides.receiver.info(), dst, timeout_s=10)
    ends, arrived, _ = sides.run_until(lambda e, a, f: e)
    sides.run_until(lambda e, a, f: sides.decode.num_pending == 0)
    assert arrived == [] and sides.dst_blocks.num_free_blocks == BLOCKS
    assert sides.src_blocks.num_free_blocks == BLOCKS


def fail_thread_once(monkeypatch: pytest.MonkeyPatch, endpoint: object) -> None:
    """Make the endpoint's thread raise at its next round (`_expire` runs every round)."""
    original = endpoint._expire
    fired = []

    def expire_then_fail(now: float) -> None:
        if fired:
            return original(now)
        fired.append(True)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(endpoint, "_expire", expire_then_fail)


def test_a_failed_sender_fails_its_sends_and_is_replaced(sides, monkeypatch):
    sides.prefilled("r1")
    sides.prefill.send("r1", "d0", sides.receiver.info(), [0, 1, 2], timeout_s=30)  # not expected
    sender = sides.prefill.senders["tcp"]
    fail_thread_once(monkeypatch, sender)
    ends, _, _ = sides.run_until(lambda e, a, f: e)
    assert [(e.request_id, e.ok) for e in ends] == [("r1", False)]
    assert "injected failure" in ends[0].error
    assert sides.src_blocks.num_free_blocks == BLOCKS and "tcp" not in sides.prefill.senders
    # The next handoff gets a fresh sender and goes through.
    sides.prefilled("r2")
    _, dst = sides.incoming("r2")
    sides.prefill.send("r2", "d0", sides.receiver.info(), dst, timeout_s=10)
    ends, arrived, _ = sides.run_until(lambda e, a, f: e and a)
    assert [(e.request_id, e.ok) for e in ends] == [("r2", True)]
    assert sides.prefill.senders["tcp"] is not sender


def test_a_decode_node_whose_receiver_failed_reports_it_and_takes_no_more_handoffs(monkeypatch):
    from conftest import RecordingLink

    from pdserve.cluster.node_messages import Admit, Admitted, TransferDone
    from pdserve.cluster.node_reports import engine_heartbeat
    from pdserve.decode_node.worker import DecodeNode
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    receivers = []

    def pool_factory(layout, num_blocks):  # noqa: ANN001, ANN202
        receivers.append(make_receiver("tcp", layout, num_blocks))
        return receivers[0].pool

    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=32, block_size=8), pool_factory)
    node = DecodeNode(engine, RecordingLink("d0"), receivers[0])
    blocks = engine.block_manager
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        node.handle(Admit("r1", list(range(5, 25)) + [30], 20, params, 30.0))
        assert node.link.sent[-1].ok and blocks.num_free_blocks == 32 - 3
        fail_thread_once(monkeypatch, receivers[0])
        deadline = time.monotonic() + 20
        while not any(isinstance(m, TransferDone) for m in node.link.sent):
            assert time.monotonic() < deadline, node.link.sent
            node.take_in()
            time.sleep(0.01)
        done = node.link.sent[-1]
        assert (done.request_id, done.ok) == ("r1", False) and "injected failure" in done.error
        assert blocks.num_free_blocks == 32 and node.handoff.num_pending == 0
        # The coordinator hears of it with every heartbeat, and admissions are refused.
        assert "injected failure" in engine_heartbeat(engine, "d0", 0, node.kv_error).kv_error
        node.handle(Admit("r2", list(range(5, 25)) + [30], 20, params, 30.0))
        assert node.link.sent[-1] == Admitted("r2", False) and blocks.num_free_blocks == 32
    finally:
        receivers[0].close()
