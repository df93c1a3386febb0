"""Starting and stopping node processes on this machine: the command line of each node, and a
group that stops them all (and never outlives its parent)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.cluster.node_options import NodeOptions
from pdserve.cluster.schema import to_flags
from pdserve.engine.config import EngineConfig, RoleTensorParallel
from pdserve.engine.cpu.threads import available_cores, node_bindings

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the node gets SIGTERM when the process that started it dies, even by SIGKILL.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class NodeSpec:
    """One node process: its role, how it joins the cluster, its engine, its environment."""

    role: str  # prefill | decode | colocated
    options: NodeOptions
    engine: EngineConfig
    env: dict[str, str] = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return self.options.node_id

    def command(self) -> list[str]:
        verb = "prefill" if self.role == "prefill" else "decode"
        cmd = [sys.executable, "-m", "pdserve", verb, *to_flags(self.options)]
        if self.role == "colocated":
            cmd.append("--colocated")
        return cmd + to_flags(self.engine)


def local_nodes(
    coordinator: str,
    engine: EngineConfig,
    *,
    prefill: int,
    decode: int,
    colocated: bool = False,
    roles: RoleTensorParallel | None = None,
    **node: object,
) -> list[NodeSpec]:
    """The nodes one machine runs for `pdserve serve`: prefill-i and decode-i, or colocated-i
    workers; `node` holds the NodeOptions settings they share, `roles` their tensor-parallel
    sizes by role."""
    roles = roles or RoleTensorParallel()

    def spec(role: str, node_id: str) -> NodeSpec:
        options = NodeOptions(coordinator=coordinator, node_id=node_id, **node)
        return NodeSpec(role, options, roles.engine_for(role, engine))

    if colocated:
        specs = [spec("colocated", f"colocated-{i}") for i in range(decode)]
    else:
        specs = [spec("prefill", f"prefill-{i}") for i in range(prefill)]
        specs += [spec("decode", f"decode-{i}") for i in range(decode)]
    return share_cores(specs)


def share_cores(specs: list[NodeSpec]) -> list[NodeSpec]:
    """Nodes started together on this host bind to disjoint shares of its cores, by
    tensor-parallel size: processes on the same cores would slow each other down many times
    over. Nodes given the same core list (cpu_bind) split that list instead. Nodes on GPUs keep
    their settings."""
    groups: dict[str | None, list[NodeSpec]] = {}
    for spec in specs:
        if not spec.engine.device.startswith("cuda"):
            bind = spec.engine.cpu_bind
            groups.setdefault(None if bind == "auto" else bind, []).append(spec)
    for bind, group in groups.items():
        sizes = [s.engine.tensor_parallel_size for s in group]
        for spec, share in zip(group, node_bindings(bind, sizes, available_cores())):
            spec.engine = replace(spec.engine, cpu_bind=share)
    return specs


class NodeGroup:
    """The node processes of one `pdserve serve`."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.roles: dict[str, str] = {}
        self.log_dir = log_dir

    def start(self, spec: NodeSpec) -> subprocess.Popen:
        env = {**os.environ, **spec.env}
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{spec.node_id}.log", "ab")  # noqa: SIM115
        # A session of its own: Ctrl-C at a terminal reaches serve alone, which stops the nodes
        # in order (they never outlive it: _die_with_parent).
        proc = subprocess.Popen(
            spec.command(),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            preexec_fn=_die_with_parent,
            start_new_session=True,
        )
        self.procs[spec.node_id] = proc
        self.roles[spec.node_id] = spec.role
        return proc

    def stop(self, timeout_s: float = 10.0, roles: tuple[str, ...] | None = None) -> None:
        """SIGTERM to the nodes (of those roles), then SIGKILL to any still up after timeout_s."""
        procs = [p for n, p in self.procs.items() if roles is None or self.roles[n] in roles]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
