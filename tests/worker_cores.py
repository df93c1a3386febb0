"""The cores a pytest-xdist worker runs on: its share of the host's (`engine.cpu.threads`'s
`split_cores`, one unit per worker), so workers started together on one host never share a core
while there are cores enough. The host's cores are kept in the environment for the tests (and
processes) that need all of them."""

from __future__ import annotations

import os

HOST_CORES_ENV = "PDSERVE_TEST_HOST_CORES"


def worker_share(host: tuple[int, ...], worker: str, count: int) -> tuple[int, ...]:
    """Worker `gwN` of `count`'s cores on a host with `host`."""
    from pdserve.engine.cpu.threads import split_cores

    return split_cores(host, [1] * count)[int(worker.removeprefix("gw"))]


def pin_this_worker() -> None:
    """Bind this pytest-xdist worker (and torch's intra-op threads) to its share of the cores;
    nothing outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    from pdserve.engine.cpu.threads import CpuPlacement, apply, format_cores

    host = host_cores()
    os.environ[HOST_CORES_ENV] = format_cores(host)
    share = worker_share(host, worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    apply(CpuPlacement(share, len(share)))


def host_cores() -> tuple[int, ...]:
    """The cores the test session was given, before any worker was bound to its share."""
    from pdserve.engine.cpu.threads import parse_cores

    given = os.environ.get(HOST_CORES_ENV)
    return parse_cores(given) if given else tuple(sorted(os.sched_getaffinity(0)))


def on_host_cores() -> None:
    """A subprocess's preexec_fn: run on all of the host's cores, as a process outside the test
    session would."""
    os.sched_setaffinity(0, host_cores())
