"""The `pdserve` and `python` commands the README's examples run under tests/test_readme.py.

`pdserve serve` runs in the background, as in a second terminal, until the next `serve` or the
end of the test: it is started, waited on until it prints its serving line, and the one before it
is stopped with Ctrl-C (SIGINT), which must leave no traceback and nothing louder than INFO. The
README's port 8000 is the test's free port (README_PORT): the test puts that port in the
examples' text; here it goes where the default would. Every other command runs as given."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

LOUD = re.compile(r"Traceback|exception was never retrieved| (WARNING|ERROR|CRITICAL) ")


def stop_server(state: Path) -> str | None:
    """Ctrl-C to the server running in the background, if any; what went wrong, or None."""
    pid_file = state / "server.pid"
    if not pid_file.exists():
        return None
    pid, log = pid_file.read_text().split(maxsplit=1)
    pid_file.unlink()
    before = len(Path(log).read_text())
    os.kill(int(pid), signal.SIGINT)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        if time.monotonic() > deadline:
            os.kill(int(pid), signal.SIGKILL)
            return f"server {pid} did not stop within 60 s of Ctrl-C"
        time.sleep(0.05)
    # No traceback ever; nothing louder than INFO from the Ctrl-C on.
    text = Path(log).read_text()
    loud = [line for line in text[before:].splitlines() if LOUD.search(line)]
    loud += ["a traceback"] if "Traceback" in text[:before] else []
    return "\n".join(["Ctrl-C of a server left:", *loud]) if loud else None


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def serve(args: list[str]) -> int:
    state = Path(os.environ["README_STATE"])
    problem = stop_server(state)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    if "--port" not in args:
        args = [*args, "--port", os.environ["README_PORT"]]
    log = state / f"server-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        # Its own session: the example's shell ends, the server stays (a second terminal).
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (state / "server.pid").write_text(f"{proc.pid} {log}")
    deadline = time.monotonic() + 240
    while "pdserve: serving http://" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            print(
                f"pdserve {' '.join(args)} did not serve:\n{log.read_text()[-3000:]}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    return 0


def main() -> int:
    tool, args = Path(sys.argv[0]).name, sys.argv[1:]
    if tool == "pdserve" and args[:1] == ["serve"]:
        return serve(args)
    if (
        tool == "python"
        and args[:2] == ["-m", "pdserve.bench.serve_load"]
        and "--base-url" not in args
    ):
        args = [*args, "--base-url", f"http://127.0.0.1:{os.environ['README_PORT']}"]
    command = [sys.executable, *(["-m", "pdserve"] if tool == "pdserve" else []), *args]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    raise SystemExit(main())
