"""Step `install`: the wheelhouse into a target directory with pip alone (`--no-index --no-deps`),
as on a GPU host without a package registry; the steps after it find the packages there through
PYTHONPATH, with the checkout itself (no build, no copy: the code under test is the checkout)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.deploy.gpu_check import deps
from pdserve.deploy.gpu_check.record import StepRecord, step_args
from pdserve.deploy.gpu_check.wheels import wheel_name_version

HOST_VERSION = tuple(int(x) for x in deps.HOST_PYTHON.split("."))


def fits_this_python(wheel: Path) -> bool:
    """Whether this interpreter takes the wheel (any of its tags among this one's)."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import parse_wheel_filename
    return not parse_wheel_filename(wheel.name)[3].isdisjoint(sys_tags())


def pip_install_command(wheels: list[Path], site: Path) -> list[str]:
    """The device README's install line, into `site`."""
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(site),
        *map(str, wheels),
    ]


def main(argv: list[str] | None = None) -> int:
    args = step_args(
        __doc__.split("\n\n")[0],
        argv,
        **{"--wheels": dict(required=True), "--site": dict(required=True)},
    )
    record = StepRecord(args.json)
    wheel_dir, site = Path(args.wheels), Path(args.site)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        record.finish(
            f"no wheels in {wheel_dir} (make gpu-wheels on a connected machine, then "
            "carry .whl); using the packages already importable",
            status="skipped",
        )
        return 0
    foreign = [w.name for w in wheels if not fits_this_python(w)]
    if foreign and sys.version_info[:2] != HOST_VERSION:
        record.finish(
            f"the wheelhouse is for CPython {deps.HOST_PYTHON} (the GPU host's) and this "
            f"is {sys.version.split()[0]}; using the packages already importable",
            status="skipped",
        )
        return 0
    pinned = {(p.name, p.version) for p in deps.read_pins()}
    present = {wheel_name_version(w) for w in wheels}
    for name, version in sorted(pinned - present):
        record.fail("wheelhouse", f"{name}=={version} is pinned but not in {wheel_dir}")
    for name, version in sorted(present - pinned):
        record.fail("wheelhouse", f"{name} {version} is there but not pinned")
    cmd = pip_install_command(wheels, site)
    record.data["command"] = " ".join(cmd)
    print(record.data["command"], flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    print(out.stdout + out.stderr, flush=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        record.fail("pip install", lines[-1] if lines else f"exit {out.returncode}")
        record.finish("pip could not install the wheelhouse")
        return 1
    record.data["installed"] = {n: v for n, v in sorted(present)}
    record.finish(f"{len(wheels)} wheels into {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
