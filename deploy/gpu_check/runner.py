"""Runs a plan's steps one after another, each as its own process in its own process group with
its log, inside its time box and the run's budget; a step whose needs the host lacks (no CUDA, no
CuPy) is skipped with the reason the env step found."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.deploy.gpu_check import deps
from pdserve.deploy.gpu_check.plan import MIN_STEP_S, Step

# A step's own deadline comes this long before its hard stop, so it can write its record.
SOFT_MARGIN_S = 8


@dataclass(slots=True)
class StepResult:
    name: str
    title: str
    status: str  # passed | failed | skipped | timed out
    seconds: float = 0.0
    box_s: float = 0.0
    summary: str = ""
    failures: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    log: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RunSettings:
    work: Path  # scratch: each step's folder and the logs (archived afterwards)
    wheels: Path
    site: Path  # where the wheels are installed
    budget_s: float
    long: bool = False
    python: str = sys.executable
    only: tuple[str, ...] = ()  # run these steps alone (and install and env)

    @property
    def logs(self) -> Path:
        return self.work / "logs"


def step_env(settings: RunSettings) -> dict[str, str]:
    """The checkout and the installed wheels first on the path, for every step and the
    processes they start (pdserve's nodes inherit it)."""
    paths = [str(deps.REPO), str(settings.site)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTHONUNBUFFERED": "1",
        "PDSERVE_CACHE": str(settings.work / "model-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def missing_needs(step: Step, facts: dict[str, Any]) -> str | None:
    """Why the host cannot run `step`, or None."""
    for need in step.needs:
        if not facts.get(need):
            return facts.get(f"{need}_why") or f"needs {need}; the env step did not establish it"
    return None


def tail(path: Path, lines: int = 3) -> str:
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:])


def run_step(step: Step, settings: RunSettings, deadline: float) -> StepResult:
    folder = settings.work / step.name
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "record.json"
    log = settings.logs / f"{step.name}.log"
    cmd = [settings.python, "-m", step.module, *step.args, "--json", str(record)]
    cmd += ["--work", str(folder), "--deadline", f"{deadline - SOFT_MARGIN_S:.3f}"]
    if settings.long:
        cmd.append("--long")
    if step.name == "install":
        cmd += ["--wheels", str(settings.wheels), "--site", str(settings.site)]
    if step.name == "env":
        cmd += ["--site", str(settings.site)]
    started = time.monotonic()
    stopped = False
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=deps.REPO,
            env=step_env(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(proc.pid, signal.SIGTERM)  # the step and everything it started
            try:
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    result = StepResult(step.name, step.title, "failed", time.monotonic() - started)
    result.log = f"logs/{step.name}.log"
    if record.exists():
        saved = json.loads(record.read_text())
        for key in ("summary", "failures", "notes", "figures", "data"):
            setattr(result, key, saved[key])
        result.status = saved["status"]
    if stopped:
        result.status = "timed out"
        result.summary = result.summary or f"stopped at its {result.seconds:.0f} s time box"
        result.failures.append(
            {"where": step.name, "what": f"stopped at its time box; last output: {tail(log)}"}
        )
    elif not record.exists() or result.status == "running" or (code and result.status == "passed"):
        # Died before it could say how it went (or said passed and exited non-zero).
        result.status = "failed"
        result.summary = f"exited {code} before finishing: {tail(log)}"
        result.failures.append({"where": step.name, "what": result.summary})
    return result


def run_plan(steps: tuple[Step, ...], settings: RunSettings) -> list[StepResult]:
    settings.logs.mkdir(parents=True, exist_ok=True)
    end = time.time() + settings.budget_s
    facts: dict[str, Any] = {}
    results: list[StepResult] = []
    slack = 0.0
    for i, step in enumerate(steps, 1):
        if settings.only and step.name not in settings.only + ("install", "env"):
            continue
        why = missing_needs(step, facts)
        now = time.time()
        deadline = min(now + step.box_s + slack, end)
        if why is None and deadline - now < MIN_STEP_S:
            why = f"no time left in the {settings.budget_s:.0f} s budget"
        print(f"[{i}/{len(steps)}] {step.name}: {step.title}", flush=True)
        if why is not None:
            result = StepResult(step.name, step.title, "skipped", summary=why)
        else:
            result = run_step(step, settings, deadline)
            result.box_s = round(deadline - now)
            slack = max(0.0, deadline - time.time())  # unused time goes to the next steps
        if step.name == "env":
            facts = result.data.get("facts", {})
        results.append(result)
        print(f"      {result.status} in {result.seconds:.0f} s: {result.summary}", flush=True)
    return results
