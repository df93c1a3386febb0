"""The multi-turn chat workload of bench.multiturn: sessions within their ranges, and each turn's
prompt is the previous turn's prompt and answer plus the turn's new message."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.multiturn import build_parser, docs_table, snapshot_table
from pdserve.bench.serving.multiturn import MultiTurnWorkload, Turn, run_session
from pdserve.cluster.client_messages import Event


def test_sessions_are_seeded_and_within_their_ranges():
    w = MultiTurnWorkload(num_sessions=5, turns=(4, 8), first_len=(10, 20), message_len=(3, 5))
    sessions = w.sample(seed=3)
    assert sessions == w.sample(seed=3) and sessions != w.sample(seed=4)
    assert len(sessions) == 5 and all(4 <= len(s) <= 8 for s in sessions)
    for turns in sessions:
        assert 10 <= len(turns[0].message) <= 20
        assert all(3 <= len(t.message) <= 5 for t in turns[1:])
        assert all(16 <= t.output_len <= 32 for t in turns)
    assert w.max_prompt_len() == 20 + 7 * (32 + 5)
    with pytest.raises(ValueError, match="turns"):
        MultiTurnWorkload(turns=(0, 2))


class EchoClient:
    """Answers every prompt with its length and its last token, as two events."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, params):  # noqa: ANN001, ANN201
        self.prompts.append(list(prompt))
        yield Event("r", token_ids=[len(prompt)])
        yield Event("r", token_ids=[prompt[-1]], finish_reason="length")


def test_each_turn_sends_the_history_and_its_new_message():
    turns = [Turn([1, 2, 3], 2), Turn([4], 2), Turn([5, 6], 2)]
    client = EchoClient()
    results = asyncio.run(run_session(client, 0, turns))
    assert client.prompts == [
        [1, 2, 3],
        [1, 2, 3, 3, 3, 4],
        [1, 2, 3, 3, 3, 4, 6, 4, 5, 6],
    ]
    assert [r.output for r in results] == [[3, 3], [6, 4], [10, 6]]
    assert [r.prompt_len for r in results] == [3, 6, 10]
    assert all(r.ttft >= 0 and r.first_gap >= 0 for r in results)


def test_the_table_has_a_row_per_system():
    run = {
        "system": "reuse-on",
        "requests": 4,
        "prompt_tokens_computed": 300,
        "prompt_tokens": 400,
        "blocks_received": 10,
        "blocks_reused": 6,
        "tier_blocks_loaded": 5,
        "kv_bytes_per_request": 2048.0,
        "ttft_ms": {"mean": 1.0, "p50": 1.0, "p90": 2.0},
        "first_gap_ms": {"mean": 3.0, "p50": 3.0, "p90": 4.0},
    }
    table = docs_table({"runs": [run, {**run, "system": "reuse-off"}]})
    assert (
        table.count("\n") == 3 and "| reuse on | 4 | 300 of 400 | 10 | 6 | 5 | 2.0 KiB |" in table
    )
    assert build_parser().parse_args(["--turns", "4:8"]).turns == (4, 8)


@pytest.mark.cluster
def test_a_short_run_with_tiers_loads_prefixes_back_and_matches_the_plain_mode(tmp_path):
    """Two servers one after the other (tiers, then reuse on without them), sessions holding
    more KV than a node's pool: the modes' outputs must be equal (the command fails otherwise),
    and the tiers mode computes fewer prompt tokens, its prefixes loaded back."""
    import json

    from pdserve.bench.multiturn import main

    out = tmp_path / "multiturn.json"
    argv = ["--modes", "tiers,reuse-on", "--sessions", "6", "--concurrency", "2", "--turns", "3"]
    argv += ["--first-len", "60", "--message-len", "20", "--output-len", "8", "--kv-blocks", "24"]
    argv += ["--block-size", "8", "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert results["command"].startswith("python -m pdserve.bench.multiturn")
    assert results["commit"] and results["date"] and results["machine"]["cpu"]
    tiers, plain = results["runs"]
    assert tiers["tier_blocks_loaded"] > 0 and plain["tier_blocks_loaded"] == 0
    assert tiers["prompt_tokens_computed"] < plain["prompt_tokens_computed"]


def test_the_snapshot_table_sets_later_turns_against_the_no_snapshots_runs():
    def run(system: str, interval: int, p50: float, p90: float) -> dict:
        return {
            "system": system,
            "linear_snapshot_interval": interval,
            "block_size": 80,
            "requests": 6,
            "prompt_tokens_computed": 500,
            "prompt_tokens": 900,
            "cached_blocks": 40,
            "first_turn_ttft_ms": {"requests": 2, "p50": 10.0, "p90": 12.0},
            "later_turns_ttft_ms": {
                "requests": 4,
                "mean_prompt_len": 200.0,
                "p50": p50,
                "p90": p90,
            },
        }

    table = snapshot_table(
        {"runs": [run("snapshots", 1, 2.0, 4.0), run("no-snapshots", 1_000_000, 8.0, 10.0)]}
    )
    lines = table.split("\n")
    assert len(lines) == 4
    assert lines[2].startswith("| 1 | snapshots | 1 | 80 | 6 (4) | 200 | 500 of 900 | 40 |")
    assert lines[2].endswith("| 2 / 4 | 4.00x / 2.50x |")
    assert lines[3].startswith("| 1 | no snapshots | 1,000,000 |")
    assert lines[3].endswith("| 1.00x / 1.00x |")


@pytest.mark.cluster
def test_a_hybrids_later_turns_compute_fewer_prompt_tokens_with_state_snapshots(
    tmp_path, checkpoint_dir
):
    """A Qwen3.5 checkpoint served twice, with its linear layers' states cached at every block
    boundary and with none: the same sessions' outputs agree (the command fails otherwise), and
    with snapshots a later turn resumes from its history's last block, so the nodes compute
    fewer prompt tokens and their caches hold the linear groups' blocks besides the full one's."""
    import json

    from pdserve.bench.multiturn import main

    out = tmp_path / "snapshots.json"
    argv = ["--model", str(checkpoint_dir("qwen3_5_text")), "--modes", "snapshots,no-snapshots"]
    argv += ["--sessions", "2", "--concurrency", "1", "--turns", "3", "--first-len", "100"]
    argv += ["--message-len", "10", "--output-len", "6", "--block-size", "8", "--kv-blocks", "256"]
    argv += ["--work-dir", str(tmp_path / "work"), "--json", str(out)]
    assert main(argv) == 0
    snapshots, none = json.loads(out.read_text())["runs"]
    assert snapshots["prompt_tokens"] == none["prompt_tokens"]
    # Each later turn's history spans several blocks: without snapshots all of it is computed.
    assert 2 * snapshots["prompt_tokens_computed"] < none["prompt_tokens_computed"]
    assert snapshots["cached_blocks"] > none["cached_blocks"] > 0
    assert (snapshots["linear_snapshot_interval"], none["linear_snapshot_interval"]) == (1, 10**6)
    assert snapshots["block_size"] > 8  # raised until a page holds a state
    assert snapshots["later_turns_ttft_ms"]["requests"] == 4
