"""pdserve installs as one package: a wheel builds without a warning, adds the import name `pdserve`
and nothing else, holds what pdserve reads at run time (the embedded model, the C kernel's
source), and a clean environment with the wheel installed (not editable) generates and serves from
outside the checkout; the checkout's folders map onto `pdserve.<folder>`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

import pdserve
from pdserve.tune.local_server import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def subpackages() -> set[str]:
    """Every package of the checkout, as installed: pdserve.<folder>[.<subfolder>...]."""
    found = {"pdserve"}
    for part in pdserve.PARTS:
        for init in (ROOT / part).rglob("__init__.py"):
            found.add(".".join(("pdserve", *init.parent.relative_to(ROOT).parts)))
    return found


def test_the_wheel_lists_every_package_and_maps_each_part_to_its_folder():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # kernels/csrc holds the C kernel's source only: a data package, declared so setuptools ships it
    assert set(setuptools["packages"]) == subpackages() | {"pdserve.kernels.csrc"}
    assert setuptools["package-dir"] == {
        "pdserve": "pdserve",
        **{f"pdserve.{part}": part for part in pdserve.PARTS},
    }
    top_level = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert top_level == {"pdserve", *pdserve.PARTS}  # a new folder is a part, or not a package


def test_a_checkout_imports_every_part_under_pdserve():
    code = "import pdserve.engine, pdserve.kv_transfer.tcp as t; print(t.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "kv_transfer" / "tcp.py"


class Installed(NamedTuple):
    wheel: Path
    venv: Path
    build_output: str  # what pip and setuptools printed while building the wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A wheel of the checkout, and a fresh virtualenv with it installed (not editable); the
    test runner's packages (torch and the rest) reach the venv by a path, not by installing."""
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes its build folder into the tree it builds.
    source = work / "source"
    ignore = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests", "docs")
    shutil.copytree(ROOT, source, ignore=ignore)
    # -v: pip shows the build backend's output, setuptools' warnings with it. Without
    # PYTHONDONTWRITEBYTECODE, which makes distutils warn that it skips byte-compiling.
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",
            "-w",
            str(work / "dist"),
            str(source),
        ],
        env=build_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (work / "dist").glob("pdserve-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    # A plain path line: the runner's site-packages without its .pth files (its editable pdserve).
    runner_site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "runner.pth").write_text(runner_site + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return Installed(wheel, venv, build.stdout + build.stderr)


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PDSERVE_MODEL")}
    return env | {"PDSERVE_CACHE": str(home / "cache"), "OMP_NUM_THREADS": "1"}


def test_the_wheel_builds_without_a_warning(installed):
    # setuptools warns and builds on where pyproject.toml and the tree disagree (a folder left out
    # of `packages`: BuildBackendWarning), and a user's `pip install` prints it.
    warned = [line for line in installed.build_output.splitlines() if "warning" in line.lower()]
    assert not warned, "\n".join(warned)


def test_the_wheel_adds_only_pdserve_and_carries_its_data(installed):
    wheel = installed.wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"pdserve"}
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["pdserve"]
    assert "pdserve/kernels/csrc/paged_attention_cpu.c" in names
    assert "pdserve/engine/embedded/pdserve-stories/model.safetensors" in names


@pytest.mark.timeout(600)
def test_an_installed_wheel_generates_and_serves_outside_the_checkout(installed, tmp_path):
    venv = installed.venv
    python = str(venv / "bin" / "python")
    env = clean_env(tmp_path)
    where = subprocess.run(
        [python, "-c", "import pdserve.engine as e, pdserve.bench.soak; print(e.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv)  # not the checkout's

    generate = subprocess.run(
        [
            str(venv / "bin" / "pdserve"),
            "generate",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "12",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generate.returncode == 0, generate.stderr
    assert generate.stdout.strip()  # the story goes on (the C kernel built from the wheel's source)

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    serve = subprocess.Popen(
        [
            str(venv / "bin" / "pdserve"),
            "serve",
            "--port",
            str(port),
            "--insecure",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while b"pdserve: serving" not in (tmp_path / "serve.log").read_bytes():
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "pdserve serve did not come up"
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}/v1"
        model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{url}/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
