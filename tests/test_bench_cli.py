"""The benchmarks as commands: `bench` installs with pdserve as `pdserve.bench` (so
`python -m pdserve.bench.X` runs from any directory), `pdserve.bench.serve_load` needs no more than
a rate and a count, and `pdserve.bench.compare` writes into the repository only when asked."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from pdserve.bench import compare, serve_load

REPO = Path(__file__).resolve().parent.parent


def test_bench_is_one_of_the_installed_packages():
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    assert {"pdserve.bench", "pdserve.bench.serving", "pdserve", "pdserve.coordinator"} <= set(
        packages
    )


def test_a_benchmark_runs_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # what an install puts on the path
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.serve_load", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    shown = " ".join(res.stdout.split())
    assert "(default: 1000.0)" in shown and "(default: 50.0)" in shown
    assert list(tmp_path.iterdir()) == []


def test_serve_load_needs_only_a_rate_and_a_count():
    args = serve_load.build_parser().parse_args(["--rate", "4", "--num-requests", "20"])
    assert args.base_url == "http://127.0.0.1:8000"  # pdserve serve's default
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (serve_load.SLO_TTFT_MS, serve_load.SLO_TPOT_MS)
    doc = " ".join((REPO / "docs" / "benchmarks.md").read_text().split())
    assert f"TTFT ≤ {serve_load.SLO_TTFT_MS:g} ms and TPOT ≤ {serve_load.SLO_TPOT_MS:g} ms" in doc


def test_compare_writes_into_the_repository_only_with_write_docs(tmp_path):
    parse = compare.build_parser().parse_args
    results, plot, doc = compare.outputs(parse([]), tmp_path)
    assert (results.parent, plot.parent, doc) == (tmp_path, tmp_path, None)
    results, plot, doc = compare.outputs(parse(["--write-docs"]), tmp_path)
    assert results == REPO / "bench/results/serving_compare.json"
    assert plot == REPO / "docs/serving_sweep.png" and doc == REPO / "docs/benchmarks.md"
    mine = tmp_path / "r.json"
    results, _, doc = compare.outputs(parse(["--results", str(mine)]), tmp_path)
    assert results == mine and doc is None


def test_the_plan_codec_benchmark_round_trips_every_plan_both_ways(capsys):
    from pdserve.bench import plan_codec

    assert plan_codec.main(["--calls", "3"]) == 0
    assert capsys.readouterr().out.count(" | ") >= 4 * len(plan_codec.PLANS)
