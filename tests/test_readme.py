"""Every fenced shell and Python example of README.md runs as written, in order, from a directory
of its own (a `deploy` link to the repository's): `pdserve serve` stays up in the background for
the examples after it, as in a second terminal, and Ctrl-C must stop it quietly. An example that
cannot run here says so in the line before its fence, `<!-- not tested: why -->`, and only those
may name a placeholder path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from readme_shim import stop_server

from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.tune.local_server import free_port

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FENCE = re.compile(
    r"(?:<!-- not tested: (?P<reason>[^>]+?) -->\n)?```(?P<lang>bash|python)\n(?P<code>.*?)^```",
    re.S | re.M,
)
# What only a reader can fill in: a model directory, another host, a cluster of one's own.
PLACEHOLDERS = re.compile(r"/path/to|~/models|/models/|10\.0\.0\.|HOST:PORT|CLUSTER\.toml|\bDIR\b")
# A model download, `make test` itself, pip installs, several hosts, GPUs, benchmarks of minutes.
MAX_NOT_TESTED = 7  # each needs a network, a GPU, several hosts or minutes
# The ports the README names, and the free ones the test serves on instead.
PORTS = ("8000", "5600")


@dataclass
class Example:
    line: int
    lang: str
    code: str
    reason: str | None  # why it is not run, if it is not

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang})"


def examples() -> list[Example]:
    text = README.read_text()
    return [
        Example(text.count("\n", 0, m.start("lang")) + 1, m["lang"], m["code"], m["reason"])
        for m in FENCE.finditer(text)
    ]


def test_only_the_examples_marked_not_tested_name_placeholders():
    found = examples()
    assert len(found) == README.read_text().count("```") // 2, "a fence the pattern misses"
    for example in found:
        if example.reason is None:
            assert not PLACEHOLDERS.search(example.code), f"{example} names a placeholder"
    skipped = [f"{e}: {e.reason}" for e in found if e.reason]
    assert len(skipped) <= MAX_NOT_TESTED, "\n".join(skipped)


@pytest.mark.timeout(1200)  # about 2 min on an idle machine: six servers start and stop
def test_every_readme_example_runs_as_written(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the README's examples use curl")
    ensure_tiny_model()  # once, before servers race to generate it
    home, bin_dir, state = tmp_path / "cwd", tmp_path / "bin", tmp_path / "state"
    for d in (home, bin_dir, state):
        d.mkdir()
    (home / "deploy").symlink_to(REPO / "deploy")
    for tool in ("pdserve", "python"):
        shim = bin_dir / tool
        shim.write_text(
            f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
            "from readme_shim import main\nraise SystemExit(main())\n"
        )
        shim.chmod(0o755)
    ports = {port: str(free_port()) for port in PORTS}
    # The README's examples run on the default model, as a user's would (the suite's is
    # pdserve-tiny).
    inherited = {k: v for k, v in os.environ.items() if k != "PDSERVE_MODEL"}
    env = {
        **inherited,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "README_PORT": ports["8000"],
        "README_STATE": str(state),
    }
    ran = 0
    try:
        for example in examples():
            if example.reason:
                continue
            code = example.code
            for port, free in ports.items():
                code = code.replace(port, free)
            command = ["bash", "-e", "-o", "pipefail", "-c", code]
            if example.lang == "python":
                command = [sys.executable, "-c", code]
            res = subprocess.run(
                command, cwd=home, env=env, capture_output=True, text=True, timeout=300
            )
            said = (
                f"{example} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
            )
            assert res.returncode == 0, said
            assert '"error"' not in res.stdout, said  # curl prints an error body and exits 0
            ran += 1
    finally:
        problem = stop_server(state)
    assert problem is None, problem
    assert ran >= 8
    # Nothing was written where the examples ran.
    assert sorted(p.name for p in home.iterdir()) == ["deploy"]
