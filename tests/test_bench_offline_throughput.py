"""bench.offline_throughput, tiny: the systems' run records its command, machine and load, and
prints the docs' tables from what it records."""

from __future__ import annotations

import json

from pdserve.bench import offline_throughput


def test_a_tiny_run_records_its_run_and_prints_the_docs_table(tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["--systems", "static,continuous", "--num-requests", "4", "--no-progress"]
    argv += ["--min-prompt-len", "4", "--max-prompt-len", "12", "--min-output-len", "2"]
    argv += ["--max-output-len", "6", "--hidden-size", "64", "--layers", "1", "--heads", "2"]
    argv += ["--kv-heads", "1", "--intermediate-size", "64", "--vocab-size", "32000"]
    argv += ["--hf-batch-size", "2", "--profile-seqs", "4", "--profile-steps", "2"]
    offline_throughput.main([*argv, "--json-out", str(out)])
    results = json.loads(out.read_text())
    assert results["command"].startswith("python -m pdserve.bench.offline_throughput --systems")
    assert results["machine"]["cpu_flags"] is not None and results["load"]["after"]
    table = offline_throughput.systems_table(results)
    assert table in capsys.readouterr().out
    assert (
        "| pdserve static (batches of 2) |" in table and "| **pdserve continuous** |" not in table
    )
    assert "continuous / static = " in table
    steps = offline_throughput.step_loop_table(results)
    assert steps.startswith("| at 4 decoding sequences") and "| schedule |" in steps


def test_a_windowed_checkpoint_runs_with_room_in_every_kv_group(checkpoint_dir, tmp_path):
    # qwen2_sliding: one full layer and two of a 12-token window, three KV groups.
    model = checkpoint_dir("qwen2_sliding")
    kv = offline_throughput.kv_manager(model, 16)
    assert kv.num_groups == 3
    assert offline_throughput.blocks_for([40, 7], kv) == 3 * 3 + 3 * 1 + 16
    out = tmp_path / "windowed.json"
    argv = ["--model", str(model), "--systems", "static,continuous", "--num-requests", "4"]
    argv += ["--min-prompt-len", "20", "--max-prompt-len", "40", "--min-output-len", "4"]
    argv += ["--max-output-len", "20", "--hf-batch-size", "2", "--no-progress"]
    argv += ["--profile-seqs", "3", "--profile-steps", "2", "--json-out", str(out)]
    offline_throughput.main(argv)
    results = json.loads(out.read_text())
    assert results["model"]["layer_types"] == ["full_attention", *["sliding_attention"] * 2]
    for system in ("static", "continuous"):
        assert results["results"][system]["output_tokens"] == results["workload"]["output_tokens"]
    assert results["decode_profile"]["num_seqs"] == 3
