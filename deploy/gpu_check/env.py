"""Step `env`: what this host is (GPU, driver, torch, Triton, CuPy, NCCL), whether every
requirement of the installed wheels and of pdserve is met by what is importable here, at the
versions really installed, and whether every pdserve module imports. Its `facts` decide which
later steps run."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

from pdserve.deploy.gpu_check import deps
from pdserve.deploy.gpu_check.record import StepRecord, step_args

# Modules whose import pulls in every other module of pdserve's import graph, CUDA paths too.
ENTRY_MODULES = (
    "pdserve.engine.llm",
    "pdserve.engine.execution.decode_graphs",
    "pdserve.kernels.triton_ops",
    "pdserve.kernels.kv_pages_triton",
    "pdserve.kernels.triton_fp8_block",
    "pdserve.kernels.triton_moe_fp8",
    "kv_transfer",
    "pdserve.kv_transfer.cuda_ipc",
    "pdserve.kv_transfer.nccl",
    "pdserve.prefill_node.worker",
    "pdserve.decode_node.worker",
    "pdserve.coordinator.api_server",
    "pdserve.serve",
    "pdserve.cli",
    "pdserve.bench.kernels",
    "pdserve.bench.model_step",
    "pdserve.bench.quant_gemm",
    "pdserve.bench.serve_load",
)

# Modules a CPU machine may lack without harm.
GPU_ONLY = ("triton", "cupy")


def run_text(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"
    return (out.stdout or out.stderr).strip()


def commit(repo: Path = deps.REPO) -> str:
    """The checkout's commit, and how many files differ from it (modified or new, not ignored):
    the code that ran is that commit only when none do."""
    text = run_text(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    if not text or " " in text:
        return "unknown (no git checkout)"
    status = run_text(["git", "-C", str(repo), "status", "--porcelain"])
    changed = [line for line in status.splitlines() if line.strip()]
    if changed:
        return f"{text} + {len(changed)} uncommitted file{'s' if len(changed) != 1 else ''}"
    return text


def cuda_facts() -> dict:
    facts: dict = {"cuda": False, "cupy": False, "gpus": 0}
    try:
        import torch
    except ImportError as exc:
        facts["cuda_why"] = f"torch does not import: {exc}"
        return facts
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    if not torch.cuda.is_available():
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        facts["cuda_why"] = "no CUDA device: torch.cuda.is_available() is False" + (
            f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
        )
    else:
        facts["cuda"] = True
        facts["gpus"] = torch.cuda.device_count()
        devices = []
        for i in range(facts["gpus"]):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "sms": p.multi_processor_count,
                }
            )
        facts["devices"] = devices
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError as exc:
        facts["triton"] = f"missing: {exc}"
    try:
        import cupy

        facts["cupy_version"] = cupy.__version__
        if facts["cuda"]:
            cupy.cuda.runtime.getDeviceCount()
            facts["cupy"] = True
            try:
                from cupy.cuda import nccl

                facts["nccl"] = nccl.get_version()  # e.g. 22703 for 2.27.3
            except Exception as exc:  # noqa: BLE001 (any failure is a fact to report)
                facts["nccl"] = f"unavailable: {exc}"
        else:
            facts["cupy_why"] = facts["cuda_why"]
    except Exception as exc:  # noqa: BLE001
        facts["cupy_why"] = f"cupy unusable: {type(exc).__name__}: {exc}"
    return facts


def gpus_listed(nvidia_smi: str) -> int:
    """GPUs in `nvidia-smi --query-gpu=<5 fields> --format=csv,noheader` output (0 where it
    failed or is absent)."""
    return sum(1 for line in nvidia_smi.splitlines() if line.count(",") >= 4)


def gpu_unusable(facts: dict) -> str | None:
    """Why the check must fail when nvidia-smi lists GPUs that torch cannot use (a driver or
    CUDA mismatch would otherwise skip every GPU step and pass); None when not so, or when
    CUDA_VISIBLE_DEVICES hides them on purpose."""
    listed = gpus_listed(facts.get("nvidia_smi", ""))
    if not listed or facts.get("cuda") or os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return None
    return f"nvidia-smi lists {listed} GPU(s) but torch cannot use them: {facts.get('cuda_why')}"


def visible_distributions() -> dict[str, str | None]:
    """Every distribution importable here, first on sys.path winning (as imports resolve)."""
    found: dict[str, str | None] = {}
    for dist in metadata.distributions():
        name = deps.canonicalize_name(dist.metadata["Name"] or "")
        found.setdefault(name, dist.version)
    return found


def main(argv: list[str] | None = None) -> int:
    args = step_args(__doc__.split("\n\n")[0], argv, **{"--site": dict(default=None)})
    record = StepRecord(args.json)
    facts = cuda_facts()
    facts["python"] = f"{platform.python_version()} ({sys.executable})"
    facts["platform"] = platform.platform()
    facts["commit"] = commit()
    facts["nvidia_smi"] = run_text(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
            "--format=csv,noheader",
        ]
    )
    record.data["facts"] = facts
    record.save()
    unusable = gpu_unusable(facts)
    if unusable is not None:
        record.fail("cuda", unusable)
    # Requirements, at the versions installed here: the wheels' own and pdserve's.
    available = visible_distributions()
    site = Path(args.site) if args.site else None
    wheels = deps.installed(site) if site and site.is_dir() else {}
    reqs = deps.check_requirements(
        deps.distribution_needs(wheels) + deps.project_needs(), available, markers=_here()
    )
    for text in reqs.missing:
        gpu_only = any(text.endswith(f"needs {n}") for n in deps.GPU_ONLY)
        if gpu_only and not facts["cuda"]:
            record.note(f"{text} (on a GPU host only)")
        else:
            record.fail("requirements", text)
    for text in reqs.conflicts:
        record.fail("requirements", text)
    record.data["requirements"] = {"missing": reqs.missing, "conflicts": reqs.conflicts}
    record.data["versions"] = {
        name: available.get(name)
        for name in sorted({*deps.CHECK_NEEDS, *(n for _, n in _names(deps.project_needs()))})
    }
    # Every module imports (a missing wheel shows here first, named).
    for name in ENTRY_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name in GPU_ONLY and not facts["cuda"]:
                record.note(f"import {name}: {exc} (needed on a GPU host only)")
            else:
                record.fail(f"import {name}", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001
            record.fail(f"import {name}", f"{type(exc).__name__}: {exc}")
    gpu = ", ".join(d["name"] for d in facts.get("devices", [])) or facts.get("cuda_why", "")
    record.finish(
        f"{gpu}; torch {facts.get('torch')} (CUDA {facts.get('torch_cuda')}), triton "
        f"{facts.get('triton')}, cupy {facts.get('cupy_version', 'missing')}, python "
        f"{platform.python_version()}"
    )
    return 0


def _here() -> dict[str, str]:
    return {**deps.HOST_MARKERS, **deps.default_environment(), "extra": ""}


def _names(needs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(who, deps.canonicalize_name(deps.Requirement(text).name)) for who, text in needs]


if __name__ == "__main__":
    sys.exit(main())
