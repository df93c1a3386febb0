"""bench.speculative, short: plain and speculative engines side by side (n-gram and a draft
model), their tokens checked equal by the bench itself, into a results file that names its run."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.speculative import main


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_short_run_records_both_sides_and_its_run(method, tmp_path):
    out = tmp_path / "spec.json"
    argv = ["--workloads", "stories", "--batches", "2", "--max-tokens", "48", "--repeats", "1"]
    argv += ["--method", method, "--json-out", str(out)]
    if method == "draft_model":
        argv += ["--draft-layers", "1"]
    main(argv)
    results = json.loads(out.read_text())
    assert results["command"].startswith("python -m pdserve.bench.speculative")
    assert results["commit"] and results["date"] and results["machine"]["cpu"]
    assert len(results["rounds"]) == 2 and results["load"]["after"]
    plain, speculative = sorted(results["runs"], key=lambda r: r["speculative"])
    assert all(r["workload"] == "stories" and r["batch"] == 2 for r in (plain, speculative))
    assert plain["draft_tokens"] == 0 and plain["steps"] == 48
    # The trained model's drafts were proposed and verified, and some kept: fewer steps.
    assert speculative["accepted_tokens"] > 0 and speculative["steps"] < 48
