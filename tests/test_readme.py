"""Every fenced shell and Python example of README.md runs as written, in order, from a directory
of its own (a `deploy` link to the repository's): `pdserve serve` stays up in the background for
the examples after it, as in a second terminal, and Ctrl-C must stop it quietly. An example that
cannot run here says so in the line before its fence, `<!-- not tested: why -->`, and only those
may name a placeholder path.

What running them here cannot show is checked by reading them: `make serve` and `make test` (the
two commands) install, then serve or test; every Python example, in the README or docs/, imports
pdserve as `pdserve.<part>`, as it must outside the checkout; every client names a model the
`serve` before it serves; and no file names the hub command huggingface_hub no longer
ships."""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from readme_shim import stop_server

import pdserve
from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.tune.local_server import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FENCE = re.compile(
    r"(?:<!-- not tested: (?P<reason>[^>]+?) -->\n)?```(?P<lang>bash|python)\n(?P<code>.*?)^```",
    re.S | re.M,
)
# What only a reader can fill in: a model directory, another host, a cluster of one's own.
PLACEHOLDERS = re.compile(r"/path/to|~/models|/models/|10\.0\.0\.|HOST:PORT|CLUSTER\.toml|\bDIR\b")
# A model download, `make test` itself, pip installs, several hosts, GPUs, benchmarks of minutes.
MAX_NOT_TESTED = 8  # each needs a network, a GPU, several hosts or minutes
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


def make_dry_run(target: str, venv: Path, *variables: str) -> list[str]:
    """The commands `make TARGET` would run in the checkout with its virtualenv at VENV (make -n)."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    # Under `make test` (CI) this make is a child of another: without its variables it prints
    # what it would run and nothing about directories.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    res = subprocess.run(
        ["make", "-n", "--no-print-directory", target, f"VENV={venv}", *variables],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    return [line.rstrip() for line in res.stdout.replace(str(venv), ".venv").splitlines()]


def test_the_two_commands_are_the_first_example():
    first = next(e for e in examples() if e.lang == "bash")
    assert [line.split("#")[0].strip() for line in first.code.splitlines()] == [
        "make serve",
        "make test",
    ]


def test_make_serve_on_a_fresh_clone_installs_the_runtime_dependencies_then_serves(tmp_path):
    commands = make_dry_run("serve", tmp_path / "venv", "ARGS=--max-model-len 1024")
    assert commands[0] == "python3 -m venv .venv"
    install = commands.index(".venv/bin/python -m pip install -q -e .")  # not the dev extra
    assert any("pip install -q torch==" in c for c in commands[:install])
    assert commands[-1] == ".venv/bin/pdserve serve --max-model-len 1024"


def test_make_serve_once_installed_only_serves(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "pdserve"):  # both newer than pyproject.toml
        (venv / "bin" / tool).touch()
    commands = make_dry_run("serve", venv)
    assert not [c for c in commands if "pip install -q -e" in c], commands
    assert commands[-1] == ".venv/bin/pdserve serve"


def test_make_test_installs_the_dev_extra_then_runs_the_suite(tmp_path):
    commands = make_dry_run("test", tmp_path / "venv")
    install = commands.index(".venv/bin/python -m pip install -q -e '.[dev]'")
    assert commands[install + 1].startswith(".venv/bin/python -m pytest")


PYTHON_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_examples() -> list[tuple[str, str]]:
    """Every Python example of the README and docs/: where it is, and its code."""
    found = []
    for doc in [README, *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in PYTHON_FENCE.finditer(text):
            found.append((f"{doc.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}", m[1]))
    return found


def test_every_python_example_imports_pdserve_by_its_installed_names():
    # From the checkout's root `import engine` works too, but nowhere else: an installed pdserve,
    # or an example pasted into another directory, has pdserve.engine only.
    found = python_examples()
    fences = sum(
        doc.read_text().count("```python") for doc in [README, *(REPO / "docs").glob("*.md")]
    )
    assert len(found) == fences, "a Python example the pattern misses"
    for where, code in found:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            bare = [name for name in names if name.split(".")[0] in pdserve.PARTS]
            assert not bare, f"{where} imports {bare[0]}: write pdserve.{bare[0]}"


# `pdserve serve [MODEL] [FLAGS]` or `make serve [ARGS="FLAGS"]` in a shell example.
SERVE = re.compile(
    r"\bpdserve serve\b(?P<args>[^\n]*)|\bmake serve\b(?: ARGS=(?P<make>\"[^\"]*\"|'[^']*'|\S+))?"
)
COMMENT = re.compile(r"(?:^|\s)#.*$", re.M)
# A request's model: in curl's JSON body, or a client's keyword argument.
MODEL = re.compile(r"""(?:"model":\s*"|\bmodel=["'])(?P<name>[^"']+)""")
CLIENT = re.compile(r"\bcurl\b|\bOpenAI\(|\bhttpx\.")


def served_names(args: list[str]) -> set[str]:
    """The model names `pdserve serve ARGS` answers to."""
    model = args[0] if args and not args[0].startswith("-") else None
    names: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--model":
            model = args[i + 1]
        elif arg == "--served-model-name":
            for name in args[i + 1 :]:
                if name.startswith("-"):
                    break
                names.append(name)
    if names:
        return set(names)
    return {Path(model).name} if model else {"pdserve-stories"}


def test_every_client_example_names_a_model_the_serve_before_it_serves():
    served: set[str] | None = None  # by the latest serve command, in the README's order
    checked = 0
    for example in examples():
        code = example.code.replace("\\\n", " ")  # a shell command on one line
        if example.lang == "bash":
            code = COMMENT.sub("", code)
        events: list[tuple[int, set[str] | str]] = []
        serves = list(SERVE.finditer(code)) if example.lang == "bash" else []
        for s in serves:
            args = s["args"] if s["make"] is None else shlex.split(s["make"])[0]
            events.append((s.end(), served_names(shlex.split(args or ""))))
        if CLIENT.search(code):
            # A model inside a serve command's flags (a draft model) is not a request's.
            events += [
                (m.start(), m["name"])
                for m in MODEL.finditer(code)
                if not any(s.start() <= m.start() < s.end() for s in serves)
            ]
        for _, event in sorted(events, key=lambda e: e[0]):
            if isinstance(event, set):
                served = event
                continue
            assert served is not None, f"{example} asks for {event!r} before any serve command"
            assert event in served, (
                f"{example} asks for {event!r}; the serve before it serves {served}"
            )
            checked += 1
    assert checked >= 2, "the curl examples' models went unseen"


# Spelled apart, so that this file passes its own check.
RETIRED_HUB_COMMAND = "huggingface" + "-cli"


def test_no_file_names_the_retired_hub_command():
    # huggingface_hub's command is `hf` (`hf download`); it no longer installs the old one.
    skip = {"build", "out", "gpu-report", "__pycache__"}
    naming = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d[0] != "." and d not in skip and not d.endswith(".egg-info")]
        naming += [
            str(Path(root, name).relative_to(REPO))
            for name in files
            if RETIRED_HUB_COMMAND.encode() in Path(root, name).read_bytes()
        ]
    assert not naming, f"{RETIRED_HUB_COMMAND} is `hf` now, still named in {naming}"


def test_make_test_runs_a_tier_in_parallel_by_its_markers(tmp_path):
    def pytest_command(*variables: str) -> str:
        lines = make_dry_run("test", tmp_path / "venv", *variables)
        joined = " ".join(line.rstrip("\\").strip() for line in lines)
        return joined.split(" -m pytest ", 1)[1]

    quick = pytest_command("MARKS=not cluster and not slow")
    assert "-n auto --dist loadfile" in quick and '-m "not cluster and not slow"' in quick
    assert " -m " not in pytest_command()  # every tier
    assert "-n 0 " in pytest_command("TEST_WORKERS=0")


TIER_REPORT = """
def pytest_collection_finish(session):
    for item in session.items:
        marks = [m for m in ("cluster", "slow") if item.get_closest_marker(m)]
        print("\\t".join(["TIER", item.nodeid, *marks]))
"""


def test_the_tiers_split_the_suite(tmp_path):
    """Each tier the README names (`cluster`, `slow`, the rest) holds tests, and a module that
    starts a cluster is in `cluster` (one collection of the whole suite, its markers read)."""
    (tmp_path / "tier_report.py").write_text(TIER_REPORT)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-p", "tier_report", "tests"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:]
    tiers: dict[str, set[str]] = {"cluster": set(), "slow": set(), "quick": set()}
    for line in res.stdout.splitlines():
        if line.startswith("TIER\t"):
            _, test, *marks = line.split("\t")
            for mark in marks or ["quick"]:
                tiers[mark].add(test)
    cluster, slow, quick = tiers["cluster"], tiers["slow"], tiers["quick"]
    assert cluster and slow and quick
    assert len(quick | cluster | slow) >= 1000  # the whole suite
    assert any(t.startswith("tests/test_windowed_cluster.py::") for t in cluster)
    assert any(t.startswith("tests/test_readme.py::") for t in slow)
    assert not any(t.startswith("tests/test_kv_groups.py::") for t in cluster | slow)
