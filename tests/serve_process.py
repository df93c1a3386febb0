"""`pdserve serve` as the tests start it: `python -m pdserve serve ARGS --port PORT` from the
repository, in a session of its own, its console in a log file; waited on until it says it serves
or its /health answers, and stopped with a signal (killed with its nodes if it hangs)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from waiting import wait_until

from pdserve.tune.local_server import free_port, stop_session

REPO = Path(__file__).resolve().parent.parent
# How long pdserve serve may take to start its nodes: two shared cores can stall for minutes.
START_S = 240.0


class ServeProcess:
    """`with ServeProcess(args, log) as serve:` runs until the block ends (SIGINT, as Ctrl-C)."""

    def __init__(
        self, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        """args: serve's arguments but --port (a free port, `port`); env: its environment (by
        default this process's)."""
        self.port = free_port()
        self.log = log
        command = [sys.executable, "-m", "pdserve", "serve", *args, "--port", str(self.port)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                start_new_session=True,  # a signal to it never reaches pytest
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text()

    def running(self) -> bool:
        """Whether it runs; an assertion error with the end of its output if it exited."""
        assert self.proc.poll() is None, f"pdserve serve exited:\n{self.output()[-4000:]}"
        return True

    def serving(self) -> bool:
        """It has said it serves (every node it starts has registered)."""
        return self.running() and f"pdserve: serving {self.url}" in self.output()

    def healthy(self) -> bool:
        """Its /health answers 200."""
        self.running()
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_serving(self, timeout_s: float = START_S) -> None:
        wait_until(self.serving, "pdserve serve's serving line", timeout_s)

    def wait_healthy(self, timeout_s: float = START_S) -> None:
        wait_until(self.healthy, "pdserve serve's /health to answer 200", timeout_s)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> None:
        """`sig` (it stops its nodes), then SIGKILL to its whole session after timeout_s."""
        stop_session(self.proc, timeout_s, sig)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
