"""The cluster one phase of `pdserve.bench.chaos` runs against: `pdserve launch` of a one-host CPU
cluster file (1 prefill + 2 decode workers), so that its supervisor restarts a node the faults
kill (`pdserve serve` does not), with the phase's faults in every process's environment; and
what the phase reads of it: its processes' memory, its nodes' KV blocks and its counters."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve import SOURCE_ROOT
from pdserve.bench.process_tree import Sessions
from pdserve.bench.serving.process_memory import pdserve_processes, resident_mib
from pdserve.engine.embedded.catalog import EMBEDDED, resolve_model_dir
from pdserve.tune.local_server import SINGLE_THREAD_ENV, free_port, stop_session

# The fault variables a phase sets; every other phase runs with neither, whatever this process's
# own environment holds.
FAULTS_ENV = "PDSERVE_FAULTS"  # node links and KV transfer messages; node steps (stall, kill)
KV_FAULTS_ENV = "PDSERVE_KV_FAULTS"  # KV pages in flight (pdserve.kv_transfer.faults)

CLUSTER_FILE = """\
model = "{model}"
{tracing}log_dir = "{log_dir}"
transport = "{transport}"
coordinator_config = "{config}"

[coordinator]
http_port = {http_port}
node_port = {node_port}
drain_timeout_s = 5.0

[[host]]
name = "local"
address = "127.0.0.1"
prefill_workers = {prefill}
decode_workers = {decode}
kv_port_base = {kv_port}

[host.prefill]
kv_cache_bytes = {kv_cache_bytes}

[host.decode]
kv_cache_bytes = {kv_cache_bytes}
"""


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports that are free now (decode node i listens on
    kv_port_base + i)."""
    for _ in range(100):
        base = free_port()
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


class ChaosCluster:
    """`with ChaosCluster(...) as cluster:` serves on `cluster.url`; the cluster file, the
    coordinator's config, the console and one log per process are kept in `work_dir`."""

    def __init__(
        self,
        work_dir: Path,
        model: str,
        config: dict[str, float],
        faults: dict[str, str],
        *,
        prefill: int = 1,
        decode: int = 2,
        transport: str = "tcp",
        kv_cache_bytes: int = 64 << 20,
        sessions: Sessions | None = None,
        startup_timeout_s: float = 300.0,
        otlp_traces_endpoint: str | None = None,
    ) -> None:
        """otlp_traces_endpoint: every process exports its traces there (and each answer names
        its trace id, in x-pdserve-trace-id)."""
        self.work_dir = work_dir
        self.sessions = sessions or Sessions()
        self.startup_timeout_s = startup_timeout_s
        self.http_port = free_port()
        work_dir.mkdir(parents=True, exist_ok=True)
        config_path = work_dir / "pdserve.toml"
        config_path.write_text("".join(f"{k} = {v!r}\n" for k, v in config.items()))
        self.path = work_dir / "cluster.toml"
        self.path.write_text(
            CLUSTER_FILE.format(
                model=model if model in EMBEDDED else resolve_model_dir(model),
                tracing=(
                    f'otlp_traces_endpoint = "{otlp_traces_endpoint}"\n'
                    if otlp_traces_endpoint
                    else ""
                ),
                log_dir=work_dir / "logs",
                transport=transport,
                config=config_path,
                http_port=self.http_port,
                node_port=free_port(),
                prefill=prefill,
                decode=decode,
                kv_port=free_ports(decode),
                kv_cache_bytes=kv_cache_bytes,
            )
        )
        self.console = work_dir / "console.txt"
        self.command = [sys.executable, "-m", "pdserve", "launch", str(self.path)]
        inherited = {k: v for k, v in os.environ.items() if k not in (FAULTS_ENV, KV_FAULTS_ENV)}
        self.env = {**inherited, **SINGLE_THREAD_ENV, **faults}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def __enter__(self) -> ChaosCluster:
        with open(self.console, "ab") as out:
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=SOURCE_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: a stray is found in it
            )
        self.sessions.add(self.proc.pid)
        try:
            self.wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def console_text(self) -> str:
        return self.console.read_text(errors="replace")

    def wait_serving(self) -> None:
        """Until the supervisor says every node registered and a one-token completion comes
        back (faults may fail a few: they are retried)."""
        deadline = time.monotonic() + self.startup_timeout_s
        probe = {"prompt": [11, 12, 13, 14], "max_tokens": 1}
        with httpx.Client(base_url=self.url, timeout=30.0) as client:
            while True:
                if not self.running():
                    raise RuntimeError(f"pdserve launch exited; see {self.console}")
                if f"pdserve: serving {self.url}" in self.console_text():
                    try:
                        if client.post("/v1/completions", json=probe).is_success:
                            return
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"pdserve launch did not serve in {self.startup_timeout_s} s"
                    )
                time.sleep(0.2)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (the coordinator drains, then every process exits), then SIGKILL to the
        session if it hangs."""
        if self.proc is not None:
            stop_session(self.proc, timeout_s)

    def restarts(self) -> dict[str, int]:
        """How many times the supervisor restarted each process, from its console."""
        counts: dict[str, int] = {}
        for line in self.console_text().splitlines():
            if " died (" in line and "restarting in" in line:
                name = line.split(" died (")[0].rsplit(" ", 1)[-1].removeprefix("pdserve-")
                counts[name] = counts.get(name, 0) + 1
        return counts

    def log_lines_naming(self, text: str) -> int:
        """Lines of its processes' logs that hold `text` (a fault layer saying it injects)."""
        count = 0
        for log in sorted((self.work_dir / "logs").glob("*.log")):
            with open(log, errors="replace") as f:
                count += sum(text in line for line in f)
        return count

    def memory(self) -> dict[str, dict[str, float]]:
        """Every pdserve process's pid and resident memory in MiB (rss, anon, shmem), by name;
        the supervisor is `launch`."""
        assert self.proc is not None
        root = self.proc.pid  # the supervisor; the coordinator is one of its children
        found = {n: pid for n, pid in pdserve_processes(root).items() if pid != root}
        found["launch"] = root
        out = {}
        for name, pid in sorted(found.items()):
            mib = resident_mib(pid)
            if mib is not None:
                out[name] = {"pid": pid, **{k: round(v, 1) for k, v in mib.items()}}
        return out


def counters(metrics_text: str) -> dict[str, float]:
    """Every pdserve counter of a /metrics page, summed over its labels but `reason`, `kind`
    and `code` (kept in the name: `pdserve_requests_finished_total{reason=stop}`)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type != "counter" or not family.name.startswith("pdserve_"):
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            kept = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k in KEPT_LABELS)
            name = f"{s.name}{{{kept}}}" if kept else s.name
            out[name] = out.get(name, 0.0) + s.value
    return out


KEPT_LABELS = ("reason", "kind", "code")
