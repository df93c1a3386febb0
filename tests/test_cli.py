"""`pdserve` as a user runs it: `--version`, every `--help`, the one-line errors of a model that is
not a local directory, `generate`'s output on a pipe and on a terminal, and a vLLM user's first
session: `pdserve serve MODEL --max-model-len 1024 --served-model-name m`, the `openai` client,
then Ctrl-C."""

from __future__ import annotations

import argparse
import os
import pty
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import ServeProcess
from waiting import wait_until

import pdserve
from pdserve.cli import HelpFormatter, build_parser, escape_controls
from pdserve.engine.embedded.tiny import ensure_tiny_model

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
PDSERVE = [sys.executable, "-m", "pdserve"]
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PDSERVE, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


# --- version and help ----------------------------------------------------------------------------


def test_version_is_the_one_the_package_declares():
    res = run("--version")
    assert res.returncode == 0 and res.stdout == f"pdserve {pdserve.__version__}\n"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pdserve.__version__"}


def test_every_option_of_every_command_has_a_help_line_that_gives_its_default():
    parser = build_parser()
    parsers = {"pdserve": parser, **subparsers(parser)}
    for name, p in parsers.items():
        assert p.description, f"{name} has no description"
        formatter = HelpFormatter(p.prog)
        for action in p._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label} has no help line"
            shown = formatter._get_help_string(action)
            flag_only = action.default is False or isinstance(action, argparse._VersionAction)
            if not (flag_only or action.required):
                assert re.search(r"default|unset", shown), f"{label}: {shown!r} gives no default"


def test_the_help_says_what_pdserve_is_and_what_each_server_command_starts():
    top = run("--help").stdout
    for words in ("OpenAI-compatible", "prefill and decode", "never downloads", "serve [MODEL]"):
        assert words in " ".join(top.split()), words
    serve = " ".join(run("serve", "--help").stdout.split())
    coordinator = " ".join(run("coordinator", "--help").stdout.split())
    assert "prefill and decode nodes as child processes" in serve
    assert "It starts no node" in coordinator and "child processes" not in coordinator
    # The engine flags, with vLLM's names, are serve's; nodes started by hand take their own.
    for flag in (
        "--max-model-len",
        "--gpu-memory-utilization",
        "--enforce-eager",
        "--seed",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
    ):
        assert flag in serve and flag not in coordinator
    for flag in ("--served-model-name", "--chat-template", "--max-pending-requests"):
        assert flag in serve and flag in coordinator


# --- models that are not local directories -------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["serve", HUB_ID],
        ["serve", "--model", HUB_ID],
        ["coordinator", HUB_ID],
        ["generate", "--model", HUB_ID, "--prompt", "hi"],
    ],
    ids=["serve", "serve --model", "coordinator", "generate"],
)
def test_a_hub_id_is_one_line_that_says_how_to_fetch_it(args):
    res = run(*args)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("pdserve: error: ") and res.stderr.count("\n") == 1
    assert f"hf download {HUB_ID} --local-dir DIR" in res.stderr
    assert "never downloads" in res.stderr


def test_other_bad_starts_are_one_line_each(tmp_path):
    for args, words in [
        (["serve", str(tmp_path / "nowhere")], "does not exist"),
        (["serve", str(tmp_path)], "has no config.json"),
        (["serve", "pdserve-tiny", "--model", str(tmp_path)], "two models given"),
        (["serve", "--max-model-len", "0"], "max_model_len must be >= 1"),
        (["serve", "--max-pending-requests", "0"], "max_pending_requests must be >= 1"),
        (["serve", "--chat-template", str(tmp_path / "none.jinja")], "cannot read the chat"),
    ]:
        res = run(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.startswith("pdserve: error: ") and res.stderr.count("\n") == 1
        assert words in res.stderr, (args, res.stderr)


def test_a_node_that_cannot_start_ends_serve_at_once(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a checkpoint with nothing else in it
    res = run("serve", str(tmp_path), "--port", "0")
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"pdserve: error: node \S+ exited \(2\) before it registered", last), last
    assert "no tokenizer.json" in res.stderr and "Traceback" not in res.stderr


# --- generate ------------------------------------------------------------------------------------

GENERATE = ["generate", "--prompt", "Hello", "--max-tokens", "32", "--ignore-eos"]


def test_escape_controls_keeps_text_newlines_and_tabs():
    assert escape_controls("a\x1b[31mb\x0ec\n\td\x7f") == "a\\x1b[31mb\\x0ec\n\td\\x7f"
    assert escape_controls("héllo, 世界") == "héllo, 世界"


def test_generate_prints_the_text_then_tokens_time_and_speed_on_stderr():
    from pdserve.engine import LLM, SamplingParams

    ensure_tiny_model()
    res = run(*GENERATE)
    assert res.returncode == 0, res.stderr
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    (expected,) = LLM().generate(["Hello"], params)
    assert res.stdout == expected.text + "\n"
    # pdserve-tiny's greedy text holds control characters: a pipe gets them as they are.
    assert escape_controls(expected.text) != expected.text
    last = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"pdserve: 32 tokens in \d+\.\d\d s \(\d+\.\d tokens/s\)", last), last

    # On a terminal, the same text with its control characters escaped.
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [*PDSERVE, *GENERATE], cwd=REPO, stdout=child, stderr=subprocess.DEVNULL
    )
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closed: the process has exited
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(60) == 0
    assert out.decode().replace("\r\n", "\n") == escape_controls(expected.text) + "\n"


# --- a vLLM user's first session -----------------------------------------------------------------


@pytest.fixture(scope="module")
def first_session(tmp_path_factory: pytest.TempPathFactory):
    """`pdserve serve pdserve-tiny --max-model-len 1024 --served-model-name m`, as typed at a
    terminal: its own process group, output on the terminal (here a file)."""
    ensure_tiny_model()
    log = tmp_path_factory.mktemp("first-session") / "console.txt"
    args = ["pdserve-tiny", "--max-model-len", "1024", "--served-model-name", "m"]
    with ServeProcess(args, log) as serve:
        serve.wait_serving()
        yield serve.proc, serve.port, log


def test_the_openai_client_sees_the_served_name_and_the_context_limit(first_session):
    _, port, _ = first_session
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    (model,) = client.models.list().data
    assert model.id == "m" and model.model_extra["max_model_len"] == 1024
    out = client.completions.create(model="m", prompt="Hello", max_tokens=8, temperature=0)
    assert out.model == "m" and out.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert chunks and all(c.model == "m" for c in chunks)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="Hello", max_tokens=1024)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="pdserve-tiny", prompt="Hello", max_tokens=1)


def test_ctrl_c_stops_everything_with_nothing_but_info_lines(first_session):
    proc, port, log = first_session
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    nodes = [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
    ]
    assert len(nodes) == 2
    before = len(log.read_text())
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal sends
    assert proc.wait(60) == 0
    console = log.read_text()
    assert "Traceback" not in console
    after = console[before:].splitlines()
    loud = [line for line in after if re.search(r" (WARNING|ERROR|CRITICAL) ", line)]
    assert loud == [], "\n".join(loud)
    wait_until(lambda: not any(map(running, nodes)), "the nodes to stop with it", timeout_s=30)


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
