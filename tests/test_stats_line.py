"""The coordinator's periodic stats line, computed from its core under a simulated clock: tokens
per second over the interval, requests per phase, KV usage per node kind, prefix-cache hits."""

from __future__ import annotations

import pytest
from test_coordinator_core import PROMPT, cluster

from pdserve.cluster.node_messages import (
    Admit,
    Admitted,
    FinishReason,
    FirstToken,
    Heartbeat,
    NodeRole,
    Prefill,
    TokenItem,
    Tokens,
)
from pdserve.coordinator.stats import StatsCounter


def counted_cluster():
    sim = cluster()
    stats = StatsCounter(sim.now)
    sim.core.listeners.append(stats.observe)
    return sim, stats


def test_an_idle_coordinator_logs_nothing():
    sim, stats = counted_cluster()
    sim.now += 10
    assert stats.sample(sim.core, sim.now) is None


def test_tokens_per_second_and_phases_over_one_interval():
    sim, stats = counted_cluster()
    for _ in range(3):
        sim.submit(max_tokens=10)
    prefills = sim.sent(Prefill, "p0")
    # The first request is prefilled, admitted, and decodes two more tokens; the second is
    # prefilled and admitted but its KV is on its way.
    for prefill in prefills[:2]:
        sim.report("p0", FirstToken(prefill.request_id, 50, None, 0, num_blocks=4))
    first, _second = sim.sent(Admit, "d0")
    sim.report("d0", Admitted(first.request_id, True, [1, 2, 3, 4]))
    sim.report("d0", Tokens("d0", [TokenItem(first.request_id, 51)]))
    sim.report("d0", Tokens("d0", [TokenItem(first.request_id, 52)]))
    sim.now += 10
    s = stats.sample(sim.core, sim.now)
    assert s is not None
    assert s.prompt_tokens_per_s == pytest.approx(2 * len(PROMPT) / 10)
    assert s.generation_tokens_per_s == pytest.approx(4 / 10)  # 50, 50, 51, 52
    assert (s.running, s.prefilling, s.transferring, s.waiting) == (1, 1, 1, 0)
    line = s.line()
    for words in (
        "prompt throughput 2.4 tokens/s",
        "generation throughput 0.4 tokens/s",
        "running 1 reqs",
        "prefilling 1 reqs",
        "transferring 1 reqs",
    ):
        assert words in line

    # The next interval counts only its own tokens; a finished request's last token once.
    sim.report("d0", Tokens("d0", [TokenItem(first.request_id, 53, FinishReason.STOP)]))
    sim.now += 5
    s = stats.sample(sim.core, sim.now)
    assert s.prompt_tokens_per_s == 0 and s.generation_tokens_per_s == pytest.approx(1 / 5)
    assert s.running == 0
    # Once nothing is left and no token came in the interval, the line stops.
    for request_id in list(sim.core.requests):
        sim.core.abort(request_id, sim.now)
    sim.now += 10
    assert stats.sample(sim.core, sim.now) is None


def test_kv_usage_per_node_kind_and_prefix_cache_hit_rate():
    sim, stats = counted_cluster()
    sim.register("c0", NodeRole.COLOCATED, num_blocks=100)
    beats = {
        "p0": Heartbeat("p0", 48, 64, 0, 0, 0, prefix_hits=30, prefix_misses=10, seq=50),
        "d0": Heartbeat("d0", 16, 64, 0, 0, 0, seq=50),
        "c0": Heartbeat("c0", 100, 100, 0, 0, 0, prefix_hits=0, prefix_misses=40, seq=50),
    }
    for node_id, beat in beats.items():
        sim.report(f"{node_id}/heartbeat", beat)
    sim.submit()
    sim.now += 10
    s = stats.sample(sim.core, sim.now)
    assert s.kv_usage == {"prefill": 0.25, "decode": 0.75, "colocated": 0.0}
    assert s.prefix_cache_hit_rate == pytest.approx(30 / 80)
    assert "KV cache usage prefill 25.0%, decode 75.0%, colocated 0.0%" in s.line()
    assert "prefix cache hit rate 37.5%" in s.line()
