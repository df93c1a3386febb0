"""Runs pdserve and a peer engine round by round, each engine in a fresh process per round: pdserve
with this interpreter (`pdserve.bench.peers.pdserve_runner`), vLLM with the interpreter of its own
virtualenv (`bench/peers/vllm_runner.py`, made by `make bench-peers`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve import SOURCE_ROOT
from pdserve.bench.peers.protocol import RoundRequest, parse_result, runner_argv, write_requests
from pdserve.bench.peers.rounds import Run, round_order
from pdserve.bench.peers.variants import DEFAULT, Variant

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS = ("vllm",)
VLLM_VENV = REPO_ROOT / ".venv-vllm"
VLLM_RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"


def peer_python(peer: str, venv: Path = VLLM_VENV) -> Path:
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    return venv / "bin" / "python"


def missing_peer(peer: str, venv: Path = VLLM_VENV) -> str | None:
    """Why the peer cannot run (one line), or None when its interpreter is there."""
    python = peer_python(peer, venv)
    if python.exists():
        return None
    return f"--peer {peer} needs vLLM's virtualenv ({python} not found): run `make bench-peers`"


def runner_command(
    engine: str,
    model_dir: Path,
    requests_path: Path,
    max_num_seqs: int,
    block_size: int,
    venv: Path = VLLM_VENV,
    variant: Variant = DEFAULT,
) -> list[str]:
    """A round's command: engine "pdserve" (run as `variant`) or a peer's name."""
    args = runner_argv(model_dir, requests_path, max_num_seqs, block_size)
    if engine == "pdserve":
        extra = ["--label", variant.label, *variant.flags]
        return [sys.executable, "-m", "pdserve.bench.peers.pdserve_runner", *args, *extra]
    return [str(peer_python(engine, venv)), str(VLLM_RUNNER), *args]


def runner_env(engine: str) -> dict[str, str]:
    """pdserve's runner finds this checkout first; the peer's sees none of it (its own packages
    only: the checkout's top-level names, `kernels` among them, would shadow its imports)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if engine == "pdserve":
        env["PYTHONPATH"] = str(SOURCE_ROOT)
    return env


def run_one(command: list[str], env: dict[str, str], timeout_s: float) -> str:
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-20:])
        raise RuntimeError(f"{command[0]} exited with {proc.returncode}:\n{tail}")
    return proc.stdout


def run_rounds(
    peer: str,
    model_dir: Path,
    requests: list[RoundRequest],
    rounds: int,
    max_num_seqs: int,
    block_size: int,
    work_dir: Path,
    on_run: Callable[[Run], None] = lambda run: None,
    timeout_s: float = 1800,
    venv: Path = VLLM_VENV,
    variants: Sequence[Variant] = (DEFAULT,),
) -> list[Run]:
    """Every round runs each pdserve variant and the peer once each, the order reversed from one
    round to the next."""
    requests_path = work_dir / "requests.json"
    write_requests(requests_path, requests)
    nproc = len(os.sched_getaffinity(0))
    by_label = {v.label: v for v in variants}
    runs = []
    for i, order in enumerate(round_order([*by_label, peer], rounds), start=1):
        for label in order:
            engine = "pdserve" if label in by_label else peer
            variant = by_label.get(label, DEFAULT)
            cmd = runner_command(
                engine, model_dir, requests_path, max_num_seqs, block_size, venv, variant
            )
            result = parse_result(run_one(cmd, runner_env(engine), timeout_s))
            expected = sum(r.output_len for r in requests)
            if result.output_tokens != expected:
                raise RuntimeError(f"{label}: {result.output_tokens} tokens, expected {expected}")
            run = Run(i, result, os.getloadavg()[0], nproc)
            runs.append(run)
            on_run(run)
    return runs
