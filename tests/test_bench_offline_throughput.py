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
