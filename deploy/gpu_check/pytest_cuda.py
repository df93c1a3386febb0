"""A pytest plugin that finds and runs the tests that skip for want of CUDA.

First, with CUDA hidden (CUDA_VISIBLE_DEVICES=""), `--cuda-skips-out FILE` records every test
whose skip marks apply there, every module skipped whole at import, and every test of
tests/test_gpu_*.py; then, on the GPU, `--cuda-select FILE` runs those alone. `--cuda-events
FILE` appends one JSON line per test phase as it ends, so a run cut short still says what passed
and what failed.

    python -m pytest -p deploy.gpu_check.pytest_cuda --collect-only --cuda-skips-out s.json tests
    python -m pytest -p deploy.gpu_check.pytest_cuda --cuda-select s.json --cuda-events e.jsonl tests
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

try:
    from _pytest.skipping import evaluate_skip_marks
except ImportError:  # pytest moved it: evaluate boolean conditions here
    evaluate_skip_marks = None

# Characters of a failure's text kept in the events (the whole of it is in the pytest log).
DETAIL_CHARS = 1500


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu-check")
    group.addoption("--cuda-skips-out", default=None, help="write the tests that skip here")
    group.addoption("--cuda-select", default=None, help="run only the tests listed there")
    group.addoption("--cuda-events", default=None, help="append one JSON line per test phase")


def skip_reason(item: pytest.Item) -> str | None:
    """Why `item` skips in this process, from its skipif marks; None if it runs. Unconditional
    skip marks are left out: they skip on a GPU as well."""
    if item.get_closest_marker("skip") is not None:
        return None
    if evaluate_skip_marks is not None:
        skipped = evaluate_skip_marks(item)
        return None if skipped is None else skipped.reason
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or (mark.kwargs.get("condition", True),)
        if any(c is True for c in conditions):
            return mark.kwargs.get("reason", "skipif")
    return None


def is_gpu_test_file(nodeid: str) -> bool:
    """tests/test_gpu_*.py hold GPU tests, all of them run, whatever their marks say; the kit's
    own CPU tests (test_gpu_check*.py) are not among them."""
    name = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return name.startswith("test_gpu_") and not name.startswith("test_gpu_check")


class Recorder:
    """Phase one: which tests and modules skip in this (CUDA-less) process."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.skipped_modules: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped and report.nodeid:
            self.skipped_modules[report.nodeid] = _skip_text(report.longrepr)
        elif report.failed:
            self.errors[report.nodeid] = _crash(report)[0]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        selected = {}
        for item in items:
            reason = skip_reason(item)
            if reason is None and is_gpu_test_file(item.nodeid):
                reason = "in a GPU test file"
            if reason is not None:
                selected[item.nodeid] = reason
        self.path.write_text(
            json.dumps(
                {
                    "tests": selected,
                    "skipped_modules": self.skipped_modules,
                    "collection_errors": self.errors,
                    "collected": len(items),
                },
                indent=1,
            )
        )


class Selector:
    """Phase two: only the recorded tests (and everything in the recorded modules) run."""

    def __init__(self, path: str) -> None:
        recorded = json.loads(Path(path).read_text())
        self.tests = set(recorded["tests"])
        self.modules = set(recorded["skipped_modules"])

    def wanted(self, item: pytest.Item) -> bool:
        return item.nodeid in self.tests or item.nodeid.split("::")[0] in self.modules

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        keep = [i for i in items if self.wanted(i)]
        dropped = [i for i in items if not self.wanted(i)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _skip_text(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr).strip().splitlines()[-1] if longrepr else ""


def _crash(report: pytest.TestReport | pytest.CollectReport) -> tuple[str, str]:
    """(short reason, where) of a failure: the exception's first line and its file:line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = (crash.message or "").strip().splitlines()
        return (message[0] if message else "failed"), f"{crash.path}:{crash.lineno}"
    text = str(report.longrepr).strip().splitlines()
    return (text[-1] if text else "failed"), ""


class Events:
    """One JSON line per test phase that ends, written by the process that reports (the
    controller under xdist)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the session)

    def write(self, event: dict) -> None:
        self.file.write(json.dumps(event) + "\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.passed:
            return  # setup and teardown matter only when they fail or skip
        event = {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "duration_s": round(report.duration, 3),
        }
        if report.skipped:
            event["reason"] = _skip_text(report.longrepr)
        elif report.failed:
            event["reason"], event["where"] = _crash(report)
            event["detail"] = report.longreprtext[-DETAIL_CHARS:]
        self.write(event)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            reason, where = _crash(report)
            self.write(
                {
                    "nodeid": report.nodeid,
                    "when": "collect",
                    "outcome": "failed",
                    "reason": reason,
                    "where": where,
                    "detail": report.longreprtext[-DETAIL_CHARS:],
                }
            )

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.file.close()


def pytest_configure(config: pytest.Config) -> None:
    opt = config.option
    if opt.cuda_skips_out:
        config.pluginmanager.register(Recorder(opt.cuda_skips_out), "gpu-check-recorder")
    if opt.cuda_select:
        config.pluginmanager.register(Selector(opt.cuda_select), "gpu-check-selector")
    if opt.cuda_events and not hasattr(config, "workerinput"):  # xdist workers report upwards
        config.pluginmanager.register(Events(opt.cuda_events), "gpu-check-events")
