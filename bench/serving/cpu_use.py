"""Where a served system's CPU goes while it serves (Linux): every process of its tree by role
(pdserve's coordinator and nodes; vLLM's API server and engine core), the CPU time each took
over a measurement from /proc, ZeroMQ's background I/O threads apart, and, with py-spy, how each
process's Python threads split their samples among the kinds of work below.

The split is sampled (py-spy `--nonblocking`, active threads only: a thread waiting for a core it
is ready to run on counts as active), so it is a share of the process's Python time, not an exact
CPU time. Native threads other than ZeroMQ's (torch's math threads) are in the process's CPU but
not in its samples."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# What one sample of a process's Python stack was doing, decided by its frames: the first kind
# below with a frame in one of its files, wherever in the stack (a sample inside the model's
# forward is FORWARD whatever it calls; a tokenizer's decode called by the detokenizer is
# detokenizing); none: OTHER (the event loop, the node loop).
FORWARD = "model forward"
OTHER = "other"
# fmt: off
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (FORWARD, ("engine/models/", "vllm/model_executor/models/", "vllm/model_executor/layers/")),
    # vLLM's processes poll their shared-memory message queues (sched_yield between looks).
    ("spinning for messages", ("vllm/distributed/device_communicators/shm_broadcast",
                               "vllm/distributed/utils")),
    # (Not the metrics middleware of vLLM's server: every response's send runs inside it.)
    ("logging and metrics", ("logging/", "prometheus_client/", "vllm/v1/metrics/")),
    ("sampling", ("engine/sampler", "vllm/v1/sample/")),
    ("KV transfer", ("kv_transfer/", "prefill_node/handoff", "prefill_node/layer_stream",
                     "decode_node/handoff")),
    ("detokenize", ("coordinator/detokenizer", "coordinator/stop_strings",
                    "vllm/v1/engine/detokenizer", "vllm/v1/engine/logprobs")),
    ("tokenize", ("coordinator/serving_tokenization", "engine/tokenizer", "transformers/",
                  "tokenizers/", "vllm/v1/engine/input_processor", "vllm/inputs/",
                  "vllm/transformers_utils/")),
    ("scheduling", ("engine/scheduler", "engine/kv/block_manager", "engine/kv/cache",
                    "vllm/v1/core/")),
    ("step preparation", ("engine/execution/runner", "engine/execution/executor", "engine/step_plan",
                          "engine/execution/forward_batch", "kernels/", "vllm/v1/worker/",
                          "vllm/v1/attention/")),
    ("node messages", ("zmq/", "cluster/codec", "cluster/node_link", "cluster/session_socket",
                       "cluster/link_session", "cluster/node_messages", "cluster/node_reports",
                       "cluster/client_messages", "cluster/schema", "msgpack", "msgspec",
                       "vllm/v1/serial_utils", "vllm/v1/engine/core_client")),
    # What the coordinator does with requests between HTTP and the nodes (vLLM's API server
    # turning its engine's outputs into requests' outputs is the same work).
    ("coordinator core", ("coordinator/coordinator", "coordinator/core", "coordinator/nodes",
                          "coordinator/admission", "coordinator/routing",
                          "coordinator/request_state", "coordinator/prefix_index",
                          "coordinator/stats", "vllm/v1/engine/output_processor")),
    ("HTTP and SSE", ("uvicorn/", "h11/", "httptools", "starlette/", "fastapi/", "anyio/",
                      "json/", "pydantic", "coordinator/", "vllm/entrypoints/",
                      "vllm/v1/engine/async_llm")),
)
# fmt: on
# ZeroMQ names its background threads so (an I/O thread per context, and its reaper).
ZMQ_THREAD = "ZMQbg/"


def _in(file: str, prefixes: tuple[str, ...]) -> bool:
    """Whether a frame's file (as py-spy shortens it, or whole) is under one of the prefixes."""
    return file.startswith(prefixes) or any(f"/{p}" in file for p in prefixes)


def classify(frames: list[str]) -> str:
    """The kind of work of one sample: `frames` outermost first, each "function (file:line)"
    as py-spy writes them."""
    files = [f.rpartition(" (")[2] for f in frames]
    for kind, prefixes in KINDS:
        if any(_in(f, prefixes) for f in files):
            return kind
    return OTHER


def split_samples(raw: str) -> Counter:
    """Samples per kind of work, from py-spy's `--format raw` output (one "frames;... N" line
    per distinct stack, outermost frame first)."""
    kinds: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            kinds[classify(stack.split(";"))] += int(count)
    return kinds


def role(cmdline: str) -> str:
    """A process's part in the system, from its command line (its title where it set one)."""
    words = cmdline.split()
    first = words[0] if words else ""
    if first.startswith("VLLM::"):
        return "vLLM " + first.removeprefix("VLLM::")
    if "vllm.entrypoints" in cmdline or first.endswith("vllm"):
        return "vLLM API server"
    if first in ("pdserve-serve", "pdserve-coordinator"):
        return "coordinator"
    if first.startswith("pdserve-"):
        return first.removeprefix("pdserve-")  # prefill-0, decode-1, tp-rank1
    return Path(first).name or "?"


def _stat(path: Path) -> list[str] | None:
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(stat: list[str]) -> float:
    return (int(stat[11]) + int(stat[12])) / TICK  # utime + stime


def tree(root: int) -> list[int]:
    """root and every live process under it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


@dataclass(slots=True)
class ProcessCPU:
    """CPU seconds of one process so far: all of it, and its ZeroMQ threads'."""

    role: str
    cpu_s: float
    zmq_s: float


def snapshot(root: int) -> dict[int, ProcessCPU]:
    """Every live process of root's tree, by pid."""
    out = {}
    for pid in tree(root):
        stat = _stat(Path(f"/proc/{pid}/stat"))
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat is None or stat[0] == "Z":
            continue
        zmq = 0.0
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                comm = (task / "comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith(ZMQ_THREAD) and (t := _stat(task / "stat")) is not None:
                zmq += _cpu_s(t)
        cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        out[pid] = ProcessCPU(role(cmdline), _cpu_s(stat), zmq)
    return out


def machine_busy_s() -> float:
    """Every core's busy time so far (/proc/stat: all but idle and iowait), in seconds."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def py_spy() -> str | None:
    """py-spy beside this interpreter, or on PATH; None if neither."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


@dataclass
class CPUUse:
    """`begin()` before a measurement and `end(tokens)` after it: the CPU the system's processes
    took in between, by role, per generated token, with the sampled split when `sample_rate_hz`
    is set (py-spy on every process, stopped at `end`)."""

    root: int
    work_dir: Path
    sample_rate_hz: int = 0
    label: str = "point"
    _before: dict[int, ProcessCPU] = field(default_factory=dict)
    _busy: float = 0.0
    _wall: float = 0.0
    _own: float = 0.0
    _spies: dict[int, tuple[subprocess.Popen, Path]] = field(default_factory=dict)

    def begin(self) -> None:
        self._before = snapshot(self.root)
        self._busy, self._wall, self._own = machine_busy_s(), time.monotonic(), time.process_time()
        self._spies = {}
        if not self.sample_rate_hz:
            return
        exe = py_spy()
        if exe is None:
            raise RuntimeError("py-spy not found: `pip install py-spy` (the dev extra has it)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for pid in self._before:
            out = self.work_dir / f"{self.label}-{pid}.txt"
            cmd = [
                exe,
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--nonblocking",
                "--full-filenames",
            ]
            cmd += ["--rate", str(self.sample_rate_hz), "--output", str(out)]
            with open(self.work_dir / f"{self.label}-{pid}.log", "wb") as log:
                self._spies[pid] = (subprocess.Popen(cmd, stdout=log, stderr=log), out)

    def end(self, tokens: int) -> dict:
        """{"wall_s", "tokens", "machine_cpu_s", "load_generator_cpu_s", "others_cores",
        "load_1m", "roles": {role: {"cpu_s", "zmq_s", "ms_per_token", "samples": {kind: n}}}}:
        others_cores is the CPU the machine's other processes took, in cores (all of it less
        the system's and this process's, the load generator's); a process that started or
        ended in between counts from its start or to its last reading."""
        after = snapshot(self.root)
        busy, wall = machine_busy_s() - self._busy, time.monotonic() - self._wall
        own = time.process_time() - self._own
        samples: dict[int, Counter] = {}
        for pid, (proc, out) in self._spies.items():
            proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if out.exists():
                samples[pid] = split_samples(out.read_text(errors="replace"))  # a torn read
        roles: dict[str, dict] = {}
        for pid in {**self._before, **after}:
            a, b = self._before.get(pid), after.get(pid)
            name = (b or a).role  # type: ignore[union-attr]
            start = a or ProcessCPU(name, 0.0, 0.0)
            end = b or a
            r = roles.setdefault(name, {"cpu_s": 0.0, "zmq_s": 0.0, "samples": Counter()})
            r["cpu_s"] += end.cpu_s - start.cpu_s  # type: ignore[union-attr]
            r["zmq_s"] += end.zmq_s - start.zmq_s  # type: ignore[union-attr]
            r["samples"].update(samples.get(pid, {}))
        for r in roles.values():
            r["ms_per_token"] = r["cpu_s"] / tokens * 1e3 if tokens else None
            r["samples"] = dict(r["samples"])
        system = sum(r["cpu_s"] for r in roles.values())
        return {
            "wall_s": wall,
            "tokens": tokens,
            "machine_cpu_s": busy,
            "load_generator_cpu_s": own,
            "others_cores": max(0.0, busy - system - own) / wall if wall > 0 else None,
            "load_1m": os.getloadavg()[0],
            "roles": roles,
        }


def kind_ms_per_token(role: dict) -> dict[str, float]:
    """A role's CPU ms per token split by kind of work: ZeroMQ's I/O threads as measured, the
    rest in proportion to the Python samples (empty without samples)."""
    total = sum(role["samples"].values())
    if not total or not role.get("ms_per_token"):
        return {}
    per_s = role["ms_per_token"] / role["cpu_s"] if role["cpu_s"] else 0.0
    zmq = role["zmq_s"] * per_s
    rest = role["ms_per_token"] - zmq
    out = {kind: rest * n / total for kind, n in role["samples"].items()}
    out["ZeroMQ I/O threads"] = zmq
    return out
