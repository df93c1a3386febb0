"""bench.speculative, short: plain and speculative engines side by side (n-gram and a draft
model), their tokens checked equal by the bench itself, into a results file that names its run."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.speculative import main


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_short_run_records_both_sides_and_its_run(method, tmp_path):
    out = tmp_path / "spec.json"
    # 64 tokens: enough for both stories to repeat a phrase the n-gram proposer finds.
    argv = ["--workloads", "stories", "--batches", "2", "--max-tokens", "64", "--repeats", "1"]
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
    assert plain["draft_tokens"] == 0 and plain["steps"] == 64
    # The trained model's drafts were proposed and verified, and some kept: fewer steps.
    assert speculative["accepted_tokens"] > 0 and speculative["steps"] < 64


def test_a_run_with_a_target_of_its_own_names_both_models(tmp_path):
    from pdserve.bench.speculative import first_layers_checkpoint
    from pdserve.engine.embedded.catalog import resolve_model_dir

    stories = resolve_model_dir("pdserve-stories")
    target = first_layers_checkpoint(stories, tmp_path / "target", 3)
    (target / "training.json").write_text(json.dumps({"shape": {"num_layers": 3}, "seconds": 1}))
    draft = first_layers_checkpoint(stories, tmp_path / "draft", 1)
    out = tmp_path / "spec.json"
    argv = ["--workloads", "stories", "--batches", "1", "--max-tokens", "24", "--repeats", "1"]
    argv += ["--method", "draft_model", "--target", str(target), "--draft", str(draft)]
    main([*argv, "--json-out", str(out)])
    results = json.loads(out.read_text())
    models = results["models"]
    assert models["target"]["path"] == str(target) and models["draft"]["path"] == str(draft)
    assert models["target"]["training"]["shape"] == {"num_layers": 3}
    assert models["target"]["parameters"] > models["draft"]["parameters"] > 0
    assert {r["model"] for r in results["runs"]} == {str(target)}
    speculative = next(r for r in results["runs"] if r["speculative"])
    assert speculative["draft_tokens"] > 0


def test_disable_by_batch_size_reaches_the_engines(tmp_path):
    out = tmp_path / "spec.json"
    argv = ["--workloads", "stories", "--batches", "1,2", "--max-tokens", "32", "--repeats", "1"]
    main([*argv, "--disable-by-batch-size", "1", "--json-out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    drafts = {r["batch"]: r["draft_tokens"] for r in runs if r["speculative"]}
    assert drafts[1] > 0 and drafts[2] == 0  # two running: over the limit, plain steps


def test_a_bench_model_named_as_the_target_is_described(tmp_path):
    out = tmp_path / "spec.json"
    argv = ["--target", "llama-9m", "--workloads", "sampled", "--batches", "1", "--repeats", "1"]
    main([*argv, "--max-tokens", "8", "--json-out", str(out)])
    target = json.loads(out.read_text())["models"]["target"]
    assert target["parameters"] > 0 and "llama-9m" in target["path"]
