"""Step `tests`: every test of the suite that skips without CUDA, run on the GPU.

Phase one collects the whole suite with CUDA hidden and records which tests skip there (and which
modules skip whole); phase two runs exactly those with the GPU visible, in parallel under
pytest-xdist where the host has it, each under a per-test timeout, one event per test written as
it ends (deploy.gpu_check.pytest_cuda), so a run stopped at the time box still reports what ran.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from pdserve.deploy.gpu_check import deps
from pdserve.deploy.gpu_check.record import StepRecord, step_args

PLUGIN = ["-p", "no:cacheprovider", "-p", "pdserve.deploy.gpu_check.pytest_cuda"]
PER_TEST_TIMEOUT_S = 120
# Outcome order: the worst phase of a test decides its outcome.
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def run_pytest(args: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, bool]:
    """(exit code, stopped at the timeout); its output goes to this step's log."""
    cmd = [sys.executable, "-m", "pytest", *PLUGIN, *args]
    print("$ " + " ".join(cmd), flush=True)
    # Its own process group, so that pytest and its xdist workers stop together.
    proc = subprocess.Popen(cmd, cwd=deps.REPO, env=env, start_new_session=True)

    def stop_pytest_too(signum: int, frame: object) -> None:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner stops this step: not a stray pytest
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop_pytest_too)
    try:
        return proc.wait(max(1.0, timeout_s)), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None, True
    finally:
        signal.signal(signal.SIGTERM, previous)


def outcomes(events_path: Path) -> dict[str, dict]:
    """Per test: its outcome (a failed setup is an error), time, and why where it did not pass."""
    tests: dict[str, dict] = {}
    if not events_path.exists():
        return tests
    for line in events_path.read_text().splitlines():
        event = json.loads(line)
        outcome = event["outcome"]
        if outcome == "failed" and event["when"] in ("setup", "collect"):
            outcome = "error"
        test = tests.setdefault(event["nodeid"], {"outcome": "passed", "seconds": 0.0})
        test["seconds"] = round(test["seconds"] + event.get("duration_s", 0.0), 3)
        if RANK[outcome] >= RANK[test["outcome"]]:
            test["outcome"] = outcome
            for key in ("reason", "where", "detail"):
                if key in event:
                    test[key] = event[key]
    return tests


def failures(tests: dict[str, dict]) -> list[dict[str, str]]:
    """The tests that failed, errored, or were selected and never reported (not a pass)."""
    out = []
    for nodeid, test in sorted(tests.items()):
        if test["outcome"] in ("failed", "error"):
            where = f" ({test['where']})" if test.get("where") else ""
            out.append({"where": nodeid, "what": test.get("reason", "") + where})
        elif test["outcome"] == "not run":
            out.append({"where": nodeid, "what": "selected but did not run"})
    return out


def no_cuda() -> str:
    """Why this host cannot run the CUDA tests ("" when it can)."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import: {e}"
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = step_args(__doc__.split("\n\n")[0], argv, **{"--workers": dict(type=int, default=6)})
    record = StepRecord(args.json)
    work = Path(args.work)
    skips, events = work / "cuda_skips.json", work / "events.jsonl"
    events.unlink(missing_ok=True)

    # Phase one: what skips where CUDA is absent.
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    code, stopped = run_pytest(
        ["--collect-only", "-q", "--cuda-skips-out", str(skips), "tests"],
        hidden,
        min(150.0, args.deadline.left() / 2),
    )
    if stopped or not skips.exists():
        record.fail("collection", "collecting the suite with CUDA hidden did not finish")
        record.finish("could not find the CUDA tests")
        return 1
    found = json.loads(skips.read_text())
    for nodeid, reason in found["collection_errors"].items():
        record.fail(nodeid, f"does not collect: {reason}")
    selected = found["tests"]
    files = sorted({n.split("::")[0] for n in selected} | set(found["skipped_modules"]))
    record.data["selection"] = {
        "collected": found["collected"],
        "selected": len(selected),
        "files": files,
        "skipped_modules": found["skipped_modules"],
    }
    record.save()
    if not selected and not found["skipped_modules"]:
        record.finish("no test skips without CUDA: nothing to run")
        return 0
    why = no_cuda()
    if why:  # every CUDA test is listed, none proven here
        tests = {n: {"outcome": "skipped", "reason": why, "seconds": 0.0} for n in selected}
        for module in found["skipped_modules"]:
            tests.setdefault(module, {"outcome": "skipped", "reason": why, "seconds": 0.0})
        record.figures = {"skipped": len(tests)}
        record.data["tests"] = tests
        record.finish(f"{why}: {len(tests)} CUDA tests not proven here", status="skipped")
        return 0

    # Phase two: those tests, on the GPU.
    options = ["-q", "-rfEs", f"--timeout={PER_TEST_TIMEOUT_S}"]
    options += ["--cuda-select", str(skips), "--cuda-events", str(events)]
    workers = min(args.workers, max(1, (os.cpu_count() or 2) // 2))
    if importlib.util.find_spec("xdist") is not None and workers > 1:
        options += ["-n", str(workers)]
    code, stopped = run_pytest(options + files, dict(os.environ), args.deadline.left() - 5)
    tests = outcomes(events)
    for nodeid in selected:
        tests.setdefault(nodeid, {"outcome": "not run", "seconds": 0.0})
    counts = Counter(t["outcome"] for t in tests.values())
    record.figures = dict(sorted(counts.items()))
    record.data["tests"] = tests
    record.failures += failures(tests)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if stopped:
        record.note(f"pytest was stopped at the step's time box; {counts['not run']} not run")
        record.finish(summary, status="timed out")
    elif code not in (0, 1) and not record.failures:
        record.fail("pytest", f"exit code {code} (see the tests log)")
        record.finish(summary)
    else:
        record.finish(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
