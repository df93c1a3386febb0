"""Where a benchmark's figures came from: the command, the code, the date, the machine and its load.

Every results file under `bench/results/` carries these, so a figure in the docs names the run it
came from (`pdserve.bench.docs` prints them under each table). A benchmark calls `start(argv)`
before it measures and `finish(record)` after, and stores the record's keys at the top of its
results file:

    record = provenance.start(sys.argv)
    ...                                   # measure
    results = provenance.finish(record) | {"rounds": ...}

`describe(results)` reads the record back, from this layout or the older ones results files
were written in before it (`machine.uptime_before`, `load_average`...), and says "not recorded"
for what a file lacks instead of guessing.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

# The instruction-set flags that decide which CPU kernels run (oneDNN, the attention kernel).
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)
NOT_RECORDED = "not recorded"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git(*args: str) -> str:
    """What `git args...` prints in the checkout ("" where there is none)."""
    return _run(["git", "-C", str(REPO_ROOT), *args])


def uptime() -> str:
    """`uptime`'s line: the clock and the load averages over 1, 5 and 15 minutes."""
    return _run(["uptime"]) or "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def cpu_model() -> str:
    for line in _run(["lscpu"]).splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The ISA flags of `ISA_FLAGS` this CPU reports, in that order."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in ISA_FLAGS if f in have]


def gpu() -> dict | None:
    """The first CUDA device torch sees and the driver nvidia-smi reports, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "name": torch.cuda.get_device_name(0),
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "driver": driver.splitlines()[0] if driver else NOT_RECORDED,
    }


def machine() -> dict[str, Any]:
    """The machine a benchmark runs on: CPU model and ISA flags, torch's CPU capability, cores,
    memory, versions, the GPU where there is one, and the load before the run (`uptime_before`,
    kept under this name for the results files written before `start`)."""
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": gpu(),
        "uptime_before": uptime(),
    }


# Results and docs written while runs wait for each other are not code a run could have run.
NOT_CODE = ("bench/results/", "docs/")


def uncommitted_files() -> int:
    """Files that differ from HEAD (modified or new, not ignored), results and docs aside: a run
    of uncommitted code."""
    paths = [ln[3:] for ln in git("status", "--porcelain").splitlines() if ln.strip()]
    return len([p for p in paths if not p.startswith(NOT_CODE)])


def start(argv: list[str]) -> dict[str, Any]:
    """The record before a run: `argv` is the command line as typed (sys.argv)."""
    return {
        "command": command_line(argv),
        "commit": git("rev-parse", "--short", "HEAD") or NOT_RECORDED,
        "uncommitted_files": uncommitted_files(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "load": {"before": uptime()},
    }


def finish(record: dict[str, Any]) -> dict[str, Any]:
    """The record after a run: the load after it, and how long it took."""
    out = dict(record)
    out["load"] = dict(record["load"]) | {"after": uptime()}
    return out


def command_line(argv: list[str]) -> str:
    """`python -m pdserve.bench.X ARGS` for a module run with -m, else the argv as given."""
    if argv and argv[0].endswith(".py"):
        path = Path(argv[0]).resolve()
        try:
            rel = path.relative_to(REPO_ROOT).with_suffix("")
            module = "pdserve." + ".".join(rel.parts)
            return shlex.join(["python", "-m", module, *argv[1:]])
        except ValueError:
            pass
    return shlex.join(argv)


# --- reading a record back ----------------------------------------------------------------------


def _load_average(line: str) -> str:
    """The 1-minute load average out of an `uptime` line ("" when it has none)."""
    m = re.search(r"load average:\s*([\d.]+)", line or "")
    return m.group(1) if m else ""


def _gpu_check(results: dict[str, Any]) -> dict[str, str]:
    """A `pdserve.deploy.gpu_check` results.json: its run record and its env step's facts."""
    run = results["run"]
    env = next((s for s in results["steps"] if s.get("name") == "env"), {})
    facts = env.get("data", {}).get("facts", {})
    smi = facts.get("nvidia_smi", "").split(", ")
    devices = facts.get("devices") or [{}]
    name = devices[0].get("name") or (smi[0] if smi[0] else NOT_RECORDED)
    gpus = f"{facts['gpus']} x {name}" if facts.get("gpus", 1) != 1 else name
    driver = f" (driver {smi[1]})" if len(smi) > 1 else ""
    return {
        "command": run.get("command") or NOT_RECORDED,
        "commit": facts.get("commit") or NOT_RECORDED,
        "date": run.get("started") or NOT_RECORDED,
        "machine": f"{gpus}{driver}, torch {facts.get('torch', NOT_RECORDED)}",
        "load": f"load {NOT_RECORDED}",
    }


def describe(results: dict[str, Any]) -> dict[str, str]:
    """command, commit, date, machine and load of a results file, each as one short phrase,
    `NOT_RECORDED` where the file does not say."""
    if isinstance(results.get("run"), dict) and isinstance(results.get("steps"), list):
        return _gpu_check(results)
    host = results.get("machine") or {}
    command = results.get("command")
    if isinstance(command, list):
        command = shlex.join(command)
    commit = results.get("commit") or NOT_RECORDED
    if results.get("uncommitted_files"):
        commit = f"{commit} (+{results['uncommitted_files']} uncommitted files)"
    date = results.get("date") or host.get("date") or NOT_RECORDED

    cpu = host.get("cpu") or host.get("processor")
    cores = host.get("cores") or host.get("nproc") or host.get("cpus")
    parts = []
    if cpu:
        parts.append(f"{cpu}, {cores} cores" if cores else str(cpu))
    if host.get("cpu_flags"):
        parts.append(" ".join(host["cpu_flags"]))
    if host.get("cpu_capability"):
        parts.append(f"torch {host['cpu_capability']}")
    gpu_info = host.get("gpu") or (
        results.get("device") if results.get("device") != "cpu" else None
    )
    if isinstance(gpu_info, dict):
        parts.append(f"{gpu_info.get('name')} (driver {gpu_info.get('driver', NOT_RECORDED)})")
    elif isinstance(gpu_info, str) and gpu_info and gpu_info != cpu:
        parts.append(gpu_info)
    machine_text = ", ".join(parts) or NOT_RECORDED

    load = results.get("load") if isinstance(results.get("load"), dict) else {}
    before = load.get("before") or host.get("uptime_before") or ""
    after = load.get("after") or host.get("uptime_after") or ""
    before, after = _load_average(before), _load_average(after)
    if not before and isinstance(host.get("load_average"), (list, tuple)):
        before = f"{host['load_average'][0]:.2f}"
    if not before and isinstance(results.get("load_average"), (list, tuple)):
        before = f"{results['load_average'][0]:.2f}"
    if not before and isinstance(results.get("load_average"), dict):  # {"before": [1, 5, 15]...}
        la = results["load_average"]
        before = f"{la['before'][0]:.2f}" if la.get("before") else ""
        after = after or (f"{la['after'][0]:.2f}" if la.get("after") else "")
    if before and after:
        load_text = f"load average {before} before, {after} after"
    elif before:
        load_text = f"load average {before} before"
    else:
        load_text = f"load {NOT_RECORDED}"
    return {
        "command": command or NOT_RECORDED,
        "commit": commit,
        "date": date,
        "machine": machine_text,
        "load": load_text,
    }
