"""Starting and stopping node processes on this machine: the command line of each node, and a
group that stops them all (and never outlives its parent)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the node gets SIGTERM when the process that started it dies, even by SIGKILL.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def engine_args(cfg: EngineConfig) -> list[str]:
    """The command-line flags that recreate cfg in a node process."""
    args = ["--dtype", cfg.dtype, "--device", cfg.device, "--block-size", str(cfg.block_size)]
    args += ["--max-num-seqs", str(cfg.max_num_seqs)]
    args += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    args += ["--scheduling-policy", cfg.scheduling_policy]
    args += ["--kernel-backend", cfg.kernel_backend]
    args += ["--cuda-graph-max-batch-size", str(cfg.cuda_graph_max_batch_size)]
    if cfg.enforce_eager:
        args.append("--enforce-eager")
    if cfg.model:
        args += ["--model", cfg.model]
    for flag, value in (
        ("--num-kv-blocks", cfg.num_kv_blocks),
        ("--kv-cache-bytes", cfg.kv_cache_bytes),
        ("--max-model-len", cfg.max_model_len),
    ):
        if value is not None:
            args += [flag, str(value)]
    if not cfg.enable_prefix_caching:
        args.append("--no-prefix-caching")
    return args


@dataclass
class NodeSpec:
    role: str  # prefill | decode | colocated
    node_id: str
    coordinator: str
    engine: EngineConfig
    transport: str = "tcp"
    heartbeat_interval_s: float = 0.5
    kv_handoff: str = "immediate"  # prefill nodes: immediate | between-steps
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        verb = "prefill" if self.role == "prefill" else "decode"
        cmd = [sys.executable, "-m", "pdserve", verb, "--coordinator", self.coordinator]
        cmd += ["--node-id", self.node_id, "--transport", self.transport]
        cmd += ["--heartbeat-interval", str(self.heartbeat_interval_s)]
        if self.role == "colocated":
            cmd.append("--colocated")
        if self.role == "prefill" and self.kv_handoff != "immediate":
            cmd += ["--kv-handoff", self.kv_handoff]
        return cmd + engine_args(self.engine)


class NodeGroup:
    """The node processes of one `pdserve serve`."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = log_dir

    def start(self, spec: NodeSpec) -> subprocess.Popen:
        env = {**os.environ, **spec.env}
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{spec.node_id}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            spec.command(), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.procs[spec.node_id] = proc
        return proc

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
