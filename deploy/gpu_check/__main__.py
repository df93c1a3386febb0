"""`python -m pdserve.deploy.gpu_check --out DIR`: install the wheelhouse, run every CUDA path of pdserve and
its benchmarks inside one 10-minute budget, and write DIR/report.md, DIR/results.json and
DIR/logs.tar.gz. Exit status 1 if a step failed or ran out of time or a measured figure missed its
aim (deploy/gpu_check/aims.py), after every file is written; an aim not measured is no pass and
no failure. On a machine without CUDA the GPU steps are skipped, each with its reason, and the
run passes. The report names the tree that ran (deploy/gpu_check/tree.py).

    python -m pdserve.deploy.gpu_check --out gpu-report          # make gpu-check
    python -m pdserve.deploy.gpu_check --out gpu-report --long   # make gpu-check-long: the full sweeps
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from pdserve.deploy.gpu_check import deps, report, tree
from pdserve.deploy.gpu_check.plan import BUDGET_S, plan
from pdserve.deploy.gpu_check.runner import RunSettings, run_plan


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.deploy.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=deps.REPO / "gpu-report",
        help="where the report, results and logs go (default: gpu-report/)",
    )
    parser.add_argument("--long", action="store_true", help="the full benchmark sweeps")
    parser.add_argument(
        "--wheels",
        type=Path,
        default=deps.REPO / ".whl",
        help="the wheelhouse to install (default: .whl/)",
    )
    parser.add_argument(
        "--site",
        type=Path,
        default=None,
        help="install the wheels here (default: a fresh scratch folder)",
    )
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="for all the steps")
    parser.add_argument("--only", default="", help="these steps alone (comma-separated)")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    settings = RunSettings(
        work=work,
        wheels=args.wheels,
        site=args.site or work / "site",
        budget_s=args.budget_s,
        long=args.long,
        only=tuple(filter(None, args.only.split(","))),
    )
    steps = plan(args.long)
    ran = tree.tree()  # before any step: the code the figures come from
    print(f"gpu-check: {len(steps)} steps in at most {args.budget_s:.0f} s; scratch {work}")
    try:
        results = run_plan(steps, settings)
        run = {
            "command": shlex.join(["python", "-m", "pdserve.deploy.gpu_check", *argv]),
            "plan": "long" if args.long else "quick",
            "started": datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "seconds": time.time() - started,
            "budget_s": args.budget_s,
            "python": sys.executable,
            "tree": ran,
        }
        files = report.write(args.out, run, results, work)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    # The first screen is printed last, so that the end of the output (a tail of the log) holds it.
    print("\n" + "\n".join(report.first_screen(run, results)))
    print("\nwrote " + ", ".join(str(f) for f in files))
    return 1 if report.failed(run, results) else 0


if __name__ == "__main__":
    sys.exit(main())
