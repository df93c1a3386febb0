"""Decode-side prefix reuse in the coordinator's core, under a simulated clock: the Admit asks
for reuse when the switch is on, SendKV skips the blocks the decode node holds, and admission
prefers the decode node that holds the longest prefix, as the nodes' KV events tell the prefix
index."""

from __future__ import annotations

from test_coordinator_core import PROMPT, Sim

from pdserve.cluster.node_messages import (
    Admit,
    Admitted,
    FinishReason,
    FirstToken,
    HandoffReady,
    NodeRole,
    Prefill,
    SendKV,
    TokenItem,
    Tokens,
    TransferDone,
)
from pdserve.coordinator.request_state import Phase


def two_decoders(**config: object) -> Sim:
    sim = Sim(**config)
    sim.register("p0", NodeRole.PREFILL)
    sim.register("d0", NodeRole.DECODE, num_blocks=64)
    sim.register("d1", NodeRole.DECODE, num_blocks=64)
    return sim


def serve_one(sim: Sim, prompt: list[int], num_reused: int = 0) -> tuple[Admit, str, SendKV]:
    """One request through admission and handoff to its end (output 99, then 51 which ends it);
    returns its Admit, the decode node it went to and the SendKV."""
    state = sim.submit(max_tokens=2, prompt=prompt)
    sim.prefill_to_first_token(state)
    (node,) = [
        n
        for n in ("d0", "d1")
        if sim.orders and any(isinstance(m, Admit) and i == n.encode() for i, m in sim.orders)
    ]
    (admit,) = sim.sent(Admit, node)
    sim.report(node, Admitted(admit.request_id, True, [1, 2, 3, 4][num_reused:], num_reused))
    (send,) = sim.sent(SendKV)
    sim.report("p0", TransferDone(send.request_id, True))
    sim.report(node, Tokens(node, [TokenItem(admit.request_id, 51, FinishReason.LENGTH)]))
    assert state.phase is Phase.DONE
    return admit, node, send


def test_the_admit_asks_for_reuse_and_sendkv_skips_the_reused_blocks():
    sim = two_decoders()
    admit, _, send = serve_one(sim, PROMPT, num_reused=3)
    assert admit.reuse_prefix
    assert send.skip_blocks == 3 and send.dst_blocks == [4]


def test_admission_prefers_the_decode_node_holding_the_prefix():
    sim = two_decoders()
    _, first, _ = serve_one(sim, PROMPT)
    # The other node now reports more free blocks: without affinity it would be chosen. The
    # holder's 8 tokens of KV more are within the rule's slack (the 12-token prefix).
    other = "d1" if first == "d0" else "d0"
    sim.cache(first, PROMPT + [99])  # its KV events: turn 1's blocks are in its prefix cache
    sim.heartbeat(first, free=62)
    sim.heartbeat(other, free=64)
    admit, node, _ = serve_one(sim, PROMPT + [99, 51, 7, 8, 9])  # turn 2: prompt + answer + more
    assert node == first and admit.reuse_prefix
    # An unrelated prompt goes by free blocks.
    _, node, _ = serve_one(sim, list(range(300, 312)))
    assert node == other


def test_with_reuse_off_the_admit_asks_for_none_and_routing_is_by_free_blocks():
    sim = two_decoders(decode_prefix_reuse=False)
    _, first, send = serve_one(sim, PROMPT)
    assert send.skip_blocks == 0
    other = "d1" if first == "d0" else "d0"
    sim.heartbeat(first, free=62)
    sim.heartbeat(other, free=64)
    admit, node, send = serve_one(sim, PROMPT + [99, 51, 7, 8, 9])
    assert node == other and not admit.reuse_prefix and send.skip_blocks == 0


def test_affinity_yields_when_the_holding_node_is_much_fuller():
    sim = two_decoders()
    _, first, _ = serve_one(sim, PROMPT)
    other = "d1" if first == "d0" else "d0"
    sim.cache(first, PROMPT + [99])
    sim.heartbeat(first, free=60)  # 16 tokens of KV against none: over 2x + the 12-token prefix
    sim.heartbeat(other, free=64)
    _, node, _ = serve_one(sim, PROMPT + [99, 51, 7, 8, 9])
    assert node == other


def test_an_early_admission_asks_for_reuse_goes_to_the_holder_and_skips_its_blocks():
    # Layer-wise streaming admits long prompts at the prefill's start; reuse applies there too.
    sim = two_decoders(kv_streaming=True, kv_streaming_min_prompt_tokens=16)
    sim.report("p0/handoff", HandoffReady("p0"))
    long = list(range(100, 132))  # 32 tokens: 8 blocks of 4

    def early(prompt: list[int], num_reused: int) -> tuple[Admit, str, SendKV]:
        state = sim.submit(max_tokens=1, prompt=prompt)
        (prefill,) = sim.sent(Prefill, "p0")
        (node,) = [
            n
            for n in ("d0", "d1")
            if any(isinstance(m, Admit) and i == n.encode() for i, m in sim.orders)
        ]
        (admit,) = sim.sent(Admit, node)
        blocks = -(-len(prompt) // 4)
        sim.report(
            node, Admitted(admit.request_id, True, list(range(num_reused, blocks)), num_reused)
        )
        (send,) = sim.sent(SendKV, "p0/handoff")
        sim.report("p0", FirstToken(prefill.request_id, 50, FinishReason.LENGTH, 0, blocks))
        sim.report("p0", TransferDone(send.request_id, True))
        assert state.phase is Phase.DONE
        return admit, node, send

    admit, first, send = early(long, 0)
    assert admit.first_token_pending and admit.reuse_prefix and send.skip_blocks == 0
    other = "d1" if first == "d0" else "d0"
    sim.cache(first, long)
    sim.heartbeat(first, free=60)
    sim.heartbeat(other, free=64)
    admit, node, send = early(long + list(range(7, 15)), 8)
    assert node == first and admit.first_token_pending and admit.reuse_prefix
    assert send.skip_blocks == 8 and send.dst_blocks == [8, 9] and send.prefilling
