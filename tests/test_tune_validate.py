"""`python -m pdserve.bench.tune_validate` end to end on a tiny workload: it profiles this machine, runs
pdserve tune, serves the three configurations for real (the pick from the config file tune wrote)
and prints predictions beside measurements. Its figures are not checked here: a few requests on a
shared machine measure nothing; docs/benchmarks.md holds a full run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_the_validation_command_runs_end_to_end(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "pdserve.bench.tune_validate",
        "--quick",
        "--rates",
        "3",
        "--duration-s",
        "1",
        "--min-requests",
        "3",
        "--transfer-gbps",
        "1",
        "--work-dir",
        str(tmp_path),
        "--json",
        str(tmp_path / "out.json"),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        # inf: a configuration measured nothing within its SLO (a loaded machine, few requests).
        r"tune validation: goodput error max (\d+|inf)%, TTFT p50 error max (\d+|inf)%, "
        r"TPOT p50 error max (\d+|inf)%, ranking (same|different)",
        last,
    ), last
    picked = re.search(r"^# tune picks: .* \((.+)\); ", out.stdout, re.M).group(1)
    # 1P+1D, 2 colocated and tune's pick, which may be one of those two: a row each at the rate.
    names = {"1P+1D", "2 colocated", picked}
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and " 3 |" in line]
    assert sorted(row.split(" | ")[0][2:] for row in rows) == sorted(names)
    # The other processes' CPU during each measurement, in cores (Linux), or "-".
    assert all(re.fullmatch(r"\d+\.\d\d|-", row.split(" | ")[-1].rstrip(" |")) for row in rows)
    assert (tmp_path / "tune" / "pdserve.toml").is_file()
    assert (tmp_path / "profile.json").is_file()
