"""Starting one pdserve configuration on this machine for a measurement (the tuner's, a
benchmark's), and stopping it: `pdserve serve` with a generated config file, waited on until
`/health` answers and a request completes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve import SOURCE_ROOT

# One math thread per process: with every node on the same few cores, torch's default (a thread
# per core in each process) oversubscribes them and a decode step takes ten times longer.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(slots=True)
class PdserveSystem:
    """One configuration under test: its nodes, coordinator config keys and engine policy."""

    name: str
    prefill_nodes: int = 1
    decode_nodes: int = 1
    colocated: bool = False
    config: dict = field(default_factory=dict)
    scheduling_policy: str = "continuous"
    flags: tuple[str, ...] = ()  # more `pdserve serve` flags (--transport tcp, --insecure)

    def serve_args(self) -> list[str]:
        if self.colocated:
            return ["--colocated", "--decode-nodes", str(self.decode_nodes), *self.flags]
        return [
            "--prefill-nodes",
            str(self.prefill_nodes),
            "--decode-nodes",
            str(self.decode_nodes),
            *self.flags,
        ]

    def config_toml(self) -> str:
        def value(v: object) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            return f'"{v}"' if isinstance(v, str) else str(v)

        config = {**self.config, "scheduling_policy": self.scheduling_policy}
        return "".join(f"{k} = {value(v)}\n" for k, v in config.items())


def stop_session(proc: subprocess.Popen, timeout_s: float, sig: int = signal.SIGTERM) -> None:
    """Stop a pdserve command started in a session of its own: `sig`, SIGTERM or SIGINT (it
    stops what it started), then SIGKILL to the whole session if it has not exited within
    timeout_s."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PdserveServer:
    """`with PdserveServer(system, work_dir) as server:` serves on `server.base_url`; the config
    file and one log per process are kept in `work_dir/<system name>`."""

    def __init__(
        self,
        system: PdserveSystem,
        work_dir: Path,
        model: str | None = None,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.system = system
        self.work_dir = Path(work_dir) / system.name
        self.model = model
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **SINGLE_THREAD_ENV, **(env or {})}
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.command: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PdserveServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.launch_command()
        self.command = cmd
        log = open(self.work_dir / "serve.log", "ab")  # noqa: SIM115
        # Its own session, so stopping it never signals this process.
        self.proc = subprocess.Popen(
            cmd,
            env=self.env,
            cwd=SOURCE_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def launch_command(self) -> list[str]:
        config_path = self.work_dir / "pdserve.toml"
        config_path.write_text(self.system.config_toml())
        cmd = [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "--port",
            str(self.port),
            "--device",
            "cpu",
        ]
        cmd += ["--config", str(config_path), "--log-dir", str(self.work_dir)]
        return cmd + (["--model", self.model] if self.model else []) + self.system.serve_args()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Until /health is 200 and a one-token completion comes back."""
        deadline = time.monotonic() + self.startup_timeout_s
        probe: dict = {"prompt": [11, 12, 13, 14], "max_tokens": 1, "stream": False}
        with httpx.Client(timeout=30.0) as client:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"{self.system.name}: pdserve exited; see {self.work_dir}")
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        models = client.get(self.base_url + "/v1/models").json()
                        probe["model"] = models["data"][0]["id"]
                        if client.post(self.base_url + "/v1/completions", json=probe).is_success:
                            return
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.system.name}: not ready in {self.startup_timeout_s} s"
                    )
                time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (pdserve stops its nodes), then SIGKILL to its process group if it hangs."""
        if self.proc is not None:
            stop_session(self.proc, timeout_s)
        self.proc = None
