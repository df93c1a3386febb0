"""bench.api_frontends, short: one server, one round of a few streamed requests per API; every
API streams the same greedy tokens (the same conversations through the same path), and the
coordinator's CPU per token of each is measured and rendered."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.api_frontends import docs_table, main

pytestmark = pytest.mark.cluster


def test_a_short_run_measures_each_api_and_renders_its_table(tmp_path, capsys):
    out = tmp_path / "frontends.json"
    argv = ["--requests", "3", "--rounds", "1", "--rate", "20", "--max-tokens", "8"]
    assert main([*argv, "--json-out", str(out)]) == 0
    results = json.loads(out.read_text())
    summary = results["summary"]
    assert set(summary) == {"chat", "responses", "messages"}
    tokens = {api: s["tokens_per_round"] for api, s in summary.items()}
    assert tokens["chat"][0] > 0 and tokens["responses"] == tokens["messages"] == tokens["chat"]
    for s in summary.values():
        assert s["coordinator_ms_per_token_median"] > 0
    assert summary["chat"]["ratio_to_chat"] == 1.0
    table = docs_table(results)
    assert table.count("\n") == 4 and "Responses" in table and "Messages" in table
    assert results["command"].endswith("--max-tokens 8 --json-out " + str(out))
