"""The wheelhouse for a GPU host without a package registry: `download` fetches exactly the pinned
wheels (deploy/gpu-wheels.txt) for CPython 3.12 on manylinux x86-64 into .whl/, and `check`
proves the set complete before it travels.

    python -m pdserve.deploy.gpu_check.wheels download      # make gpu-wheels runs both
    python -m pdserve.deploy.gpu_check.wheels check

What `check` proves, on this machine whatever its own Python: the set is the pins, one wheel
each; pip accepts every wheel for CPython 3.12 on manylinux_2_28 x86-64 (`--target` install with
the host's tags); every requirement the wheels and pdserve declare is met by the set or named on
the host's list (at a compatible version where the list gives one); every module the code
imports, lazily or not, comes from the set, the host's list or the stdlib. With a CPython 3.12
at hand (`python3.12`, pyenv's, or GPU_CHECK_PYTHON) it also imports each wheel and pdserve's
torch-free modules in an isolated 3.12 interpreter (-I -S) that sees only the stdlib, the
installed set, the checkout and, for names on the host's list alone, this machine's copies.
What it cannot prove: the host's own versions where the list gives none (gpu-check's env step
checks those on the host), that torch-side modules import (no CUDA torch here; their imports are
checked by name), or that the host's glibc takes manylinux_2_28.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.deploy.gpu_check import deps

WHEEL_DIR = deps.REPO / ".whl"
# The wheelhouse travels to the GPU host with the working tree: at most 48 MiB, so that the
# two together stay under 64 MiB.
WHEELS_BUDGET_BYTES = 48 << 20


def host_tag_flags() -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", deps.HOST_PYTHON, "--implementation", "cp"]
    for platform in deps.HOST_PLATFORMS:
        flags += ["--platform", platform]
    return flags


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return deps.canonicalize_name(name), version


def download(dest: Path = WHEEL_DIR, pins: list[deps.Pin] | None = None) -> list[Path]:
    """Fetch the pinned wheels into dest, and remove any other wheel there (one version each)."""
    pins = pins if pins is not None else deps.read_pins()
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *host_tag_flags(), "-d", str(dest)]
    subprocess.run(cmd + [p.spec for p in pins], check=True)
    wanted = {(p.name, p.version) for p in pins}
    kept = []
    for path in sorted(dest.glob("*.whl")):
        if wheel_name_version(path) in wanted:
            kept.append(path)
        else:
            print(f"removing {path.name}: not pinned")
            path.unlink()
    return kept


# --- the check ----------------------------------------------------------------------------------


@dataclass(slots=True)
class CheckResult:
    lines: list[str] = field(default_factory=list)  # what was checked, in order
    problems: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.lines.append(text)

    def fail(self, text: str) -> None:
        self.problems.append(text)
        self.lines.append("PROBLEM: " + text)


def find_python312() -> str | None:
    """A CPython 3.12 for the import probe: GPU_CHECK_PYTHON, python3.12, or pyenv's."""
    candidates = [os.environ.get("GPU_CHECK_PYTHON"), shutil.which("python3.12")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += [str(p) for p in sorted(pyenv.glob("3.12*/bin/python3.12"), reverse=True)]
    for exe in filter(None, candidates):
        try:
            out = subprocess.run(
                [exe, "-I", "-S", "-c", "import sys; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return exe
    return None


# Runs in the isolated 3.12: sys.path is the stdlib, the installed set and the checkout; a module
# found nowhere there loads from this machine's site-packages only if the host list names it.
PROBE = r"""
import importlib, importlib.abc, importlib.machinery, json, pkgutil, sys, traceback
cfg = json.loads(sys.argv[1])
sys.path[:0] = [cfg["site"], cfg["repo"]]
host = set(cfg["host_modules"])

class HostPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if path is None and name in host:
            return importlib.machinery.PathFinder.find_spec(name, [cfg["stand_in"]])
        return None

sys.meta_path.append(HostPackages())  # last: the stdlib, the set and the checkout come first
results = {}

def probe(name):
    try:
        importlib.import_module(name)
        results[name] = "ok"
    except BaseException as exc:
        results[name] = f"{type(exc).__name__}: {exc}"

for name in cfg["modules"]:
    probe(name)
for package in cfg["walk"]:
    probe(package)
    module = sys.modules.get(package)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), package + "."):
        probe(info.name)
# Entry points need the .dist-info directories of the --target tree (opentelemetry's context).
from opentelemetry import context
context.get_current()
results["opentelemetry context entry point"] = "ok"
from_host = sorted(
    n for n, m in sys.modules.items()
    if "." not in n and getattr(m, "__file__", None) and m.__file__.startswith(cfg["stand_in"])
)
print(json.dumps({"results": results, "from_host_list": from_host}))
"""

# pdserve's modules that import without torch (tests/test_torch_free.py keeps them so): the ones
# that use the pinned wheels.
TORCH_FREE = {"walk": ["cluster", "coordinator"], "modules": ["pdserve.serve", "pdserve.cli"]}
# Wheels that import torch themselves: this machine's torch cannot load in the isolated 3.12, so
# they are imported on the host by gpu-check's env step instead.
TORCH_SIDE_WHEELS = {"xgrammar"}


def import_probe(python: str, site: Path, modules: list[str], host_modules: list[str]) -> dict:
    cfg = {
        "site": str(site),
        "repo": str(deps.REPO),
        "stand_in": sysconfig.get_paths()["purelib"],
        "host_modules": host_modules,
        "modules": modules + TORCH_FREE["modules"],
        "walk": TORCH_FREE["walk"],
    }
    out = subprocess.run(
        [python, "-I", "-S", "-c", PROBE, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tempfile.gettempdir(),  # not the checkout: -I already keeps '' off sys.path
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(wheel_dir: Path = WHEEL_DIR, python312: str | None = None) -> CheckResult:
    result = CheckResult()
    pins = deps.read_pins()
    host = deps.read_host()
    wheels = sorted(wheel_dir.glob("*.whl"))
    # 1. The set is the pins, one wheel each.
    found = {}
    for path in wheels:
        found.setdefault(wheel_name_version(path)[0], []).append(path)
    for pin in pins:
        have = found.pop(pin.name, [])
        if [wheel_name_version(p)[1] for p in have] != [pin.version]:
            result.fail(f"{pin.spec}: found {[p.name for p in have] or 'no wheel'}")
    for extra in found.values():
        result.fail(f"not pinned: {', '.join(p.name for p in extra)}")
    total = sum(p.stat().st_size for p in wheels)
    for path in wheels:
        result.note(f"{path.stat().st_size / 2**20:8.2f} MiB  {path.name}")
    result.note(f"{total / 2**20:8.2f} MiB  in all, {len(wheels)} wheels")
    if total > WHEELS_BUDGET_BYTES:
        result.fail(f"{total / 2**20:.1f} MiB is over {WHEELS_BUDGET_BYTES >> 20} MiB")
    if result.problems:
        return result
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        site = Path(tmp) / "site"
        # 2. pip takes each wheel for the host's interpreter and platform, from nothing but them.
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--target", str(site), *host_tag_flags(), *map(str, wheels)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            result.fail("pip refused the set for CPython 3.12 manylinux: " + out.stderr.strip())
            return result
        result.note(f"installed for CPython {deps.HOST_PYTHON} manylinux x86-64 with --no-index")
        dists = deps.installed(site)
        # 3. Each wheel provides the import names the import scan assumes of it.
        modules = {}
        for pin in pins:
            tops = deps.top_level_modules(dists[pin.name])
            if not set(deps.import_names(pin.name)) <= tops:
                result.fail(
                    f"{pin.name} installs {sorted(tops)}, not {deps.import_names(pin.name)}"
                )
            modules.update({m: f"wheel: {pin.name}" for m in tops})
        # 4. Declared requirements, of the wheels and of pdserve, against the set and the host.
        available = dict(host) | {p.name: p.version for p in pins}
        reqs = deps.check_requirements(
            deps.distribution_needs(dists) + deps.project_needs(), available
        )
        for text in reqs.missing + reqs.conflicts:
            result.fail(text)
        result.note(
            f"requirements: met by the set and the host list ({len(reqs.unverified)} "
            "at versions the list does not give, checked on the host by gpu-check)"
        )
        for text in reqs.unverified:
            result.note("  unverified here: " + text)
        # 5. Every import of the code, by name.
        provided = deps.host_import_names(host) | modules
        for name, files in sorted(deps.uncovered_imports(provided).items()):
            result.fail(f"`import {name}` ({', '.join(sorted(files)[:3])}) has no provider")
        scanned = deps.third_party_imports()
        result.note(f"imports: all {len(scanned)} third-party names the code uses are provided")
        # 6. Import for real in an isolated CPython 3.12.
        python312 = python312 or find_python312()
        if python312 is None:
            result.note("import probe: not run (no CPython 3.12 here; set GPU_CHECK_PYTHON)")
            return result
        host_modules = sorted(deps.host_import_names(host))
        torch_side = sorted(m for m in modules if m in TORCH_SIDE_WHEELS)
        probed = sorted(m for m in modules if m not in TORCH_SIDE_WHEELS)
        probe = import_probe(python312, site, probed, host_modules)
        if "error" in probe:
            result.fail(f"import probe under {python312} failed: {probe['error']}")
            return result
        bad = {k: v for k, v in probe["results"].items() if v != "ok"}
        for name, error in sorted(bad.items()):
            result.fail(f"import {name} under CPython 3.12 -I -S: {error}")
        result.note(
            f"import probe ({python312} -I -S): {len(probe['results']) - len(bad)} of "
            f"{len(probe['results'])} imports ok; host-list packages loaded from this machine: "
            + ", ".join(probe["from_host_list"])
        )
        if torch_side:
            result.note(
                f"not imported here (they import torch; the host's env step does): {torch_side}"
            )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["download", "check"])
    parser.add_argument("--dir", type=Path, default=WHEEL_DIR, help="the wheelhouse (.whl/)")
    args = parser.parse_args(argv)
    if args.action == "download":
        download(args.dir)
        return 0
    result = check(args.dir)
    print("\n".join(result.lines))
    if result.problems:
        print(f"\n{len(result.problems)} problem(s): the wheel set is not ready", file=sys.stderr)
        return 1
    print(f"\nthe wheel set in {args.dir} is complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
