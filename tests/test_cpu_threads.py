"""Where a CPU engine's threads run: core lists, the split of a host's cores among the nodes
started on it and among a node's ranks, and a real engine process bound as its flags say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from worker_cores import host_cores, on_host_cores

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.threads import (
    format_cores,
    node_bindings,
    parse_cores,
    placement,
    split_cores,
)

ROOT = Path(__file__).parent.parent


def test_core_lists_parse_and_print_back():
    assert parse_cores("0-1") == (0, 1)
    assert parse_cores("0,2") == (0, 2)
    assert parse_cores("4, 0-2,1") == (4, 0, 1, 2)
    assert format_cores((5, 0, 1, 2)) == "0-2,5"
    assert format_cores(parse_cores("0,2-3")) == "0,2-3"
    for bad in ("", "a", "1-0", "-1", "0-x"):
        with pytest.raises(ValueError, match="cpu_bind"):
            parse_cores(bad)
    with pytest.raises(ValueError, match="cpu_bind"):
        EngineConfig(cpu_bind="0..3")
    assert EngineConfig(cpu_bind="auto").cpu_bind == "auto"


def test_cores_split_disjoint_in_proportion_to_weights():
    assert split_cores((0, 1), [1, 1]) == [(0,), (1,)]
    assert split_cores(range(8), [1, 1, 2]) == [(0, 1), (2, 3), (4, 5, 6, 7)]
    assert split_cores(range(5), [1, 1]) == [(0, 1), (2, 3, 4)]
    for n in range(1, 9):
        for weights in ([1] * n, [2] + [1] * (n - 1)):
            parts = split_cores(range(16), weights)
            flat = [c for p in parts for c in p]
            assert sorted(flat) == list(range(16)) and len(set(flat)) == 16
            assert all(parts)


def test_more_nodes_than_cores_share_cores_round_robin_one_each():
    assert split_cores((0, 1), [1, 1, 1, 1]) == [(0,), (1,), (0,), (1,)]
    assert split_cores((0, 1), [2, 1]) == [(0, 1), (0,)]
    with pytest.raises(ValueError):
        split_cores((), [1])


def test_nodes_started_together_bind_their_shares():
    assert node_bindings(None, [1, 1], (0, 1, 2, 3)) == ["0-1", "2-3"]
    assert node_bindings("auto", [1, 1, 1, 1], (0, 1)) == ["0", "1", "0", "1"]
    assert node_bindings("4-7", [1, 1], (0, 1)) == ["4-5", "6-7"]  # the cores given


def test_a_ranks_placement():
    # Unbound: threads are the rank's share of what it may use.
    assert placement(None, None, 0, 1, (0, 1)).cores is None
    assert placement(None, None, 1, 2, (0, 1, 2, 3)).threads == 2
    # Bound: the rank's share of the list, one thread per core unless told.
    assert placement("0-3", None, 1, 2, (0,)) == placement("2-3", None, 0, 1, ())
    assert placement("0-3", None, 1, 2, (0,)).cores == (2, 3)
    assert placement("auto", 1, 0, 1, (0, 1)).threads == 1
    assert placement("auto", None, 0, 1, (3, 1)).cores == (1, 3)


PROBE = """
import json, os, sys, torch
from pdserve.engine import LLM
llm = LLM("pdserve-tiny", cpu_threads=1, cpu_bind=sys.argv[1], device="cpu", num_kv_blocks=8)
out = llm.generate([[5, 6, 7]], __import__("pdserve.engine", fromlist=["SamplingParams"]).SamplingParams(max_tokens=2, temperature=0))
bound = (sorted(os.sched_getaffinity(0)), torch.get_num_threads(), len(out[0].token_ids))
llm.close()
print(json.dumps({"bound": bound, "after": [sorted(os.sched_getaffinity(0)),
                                            torch.get_num_threads()]}))
"""


@pytest.mark.skipif(len(host_cores()) < 2, reason="binding needs two cores to show")
def test_an_engine_process_runs_on_the_cores_and_threads_it_was_given():
    last = max(host_cores())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(last)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=on_host_cores,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["bound"] == [[last], 1, 2]
    # Closing the engine gives the process back its cores and threads.
    assert seen["after"] == [list(host_cores()), 2]


FAILING_PROBE = """
import json, os, sys, torch
from pdserve.engine import LLM
try:
    LLM(sys.argv[2], cpu_threads=1, cpu_bind=sys.argv[1], device="cpu", num_kv_blocks=8)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "after": [sorted(os.sched_getaffinity(0)),
                                                             torch.get_num_threads()]}))
"""


@pytest.mark.skipif(len(host_cores()) < 2, reason="binding needs two cores to show")
def test_an_engine_that_fails_to_start_gives_back_the_cores_and_threads(tmp_path):
    """The weights fail to load after the engine bound its process: the process is unbound."""
    import shutil

    from pdserve.engine.embedded.tiny import ensure_tiny_model

    model = tmp_path / "broken"
    shutil.copytree(ensure_tiny_model(), model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    last = max(host_cores())
    out = subprocess.run(
        [sys.executable, "-c", FAILING_PROBE, str(last), str(model)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=on_host_cores,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["after"] == [list(host_cores()), 2], seen


def test_a_node_command_carries_its_placement():
    from pdserve.cli import build_parser
    from pdserve.cluster.node_options import NodeOptions
    from pdserve.launch import NodeSpec

    options = NodeOptions(coordinator="tcp://127.0.0.1:1", node_id="decode-0", insecure=True)
    spec = NodeSpec("decode", options, EngineConfig(cpu_threads=1, cpu_bind="0,2"))
    args = build_parser().parse_args(spec.command()[3:])
    assert (args.cpu_threads, args.cpu_bind) == (1, "0,2")


def test_the_nodes_serve_starts_split_the_hosts_cores(monkeypatch):
    from pdserve import launch
    from pdserve.engine.config import RoleTensorParallel

    monkeypatch.setattr(launch, "available_cores", lambda: tuple(range(8)))
    engine = EngineConfig(device="cpu")
    specs = launch.local_nodes("tcp://127.0.0.1:1", engine, prefill=2, decode=2, insecure=True)
    assert [s.engine.cpu_bind for s in specs] == ["0-1", "2-3", "4-5", "6-7"]
    roles = RoleTensorParallel(decode_tensor_parallel_size=2)
    specs = launch.local_nodes(
        "tcp://127.0.0.1:1", engine, prefill=2, decode=1, roles=roles, insecure=True
    )
    assert [s.engine.cpu_bind for s in specs] == ["0-1", "2-3", "4-7"]
    # A core list given is what they split; GPU nodes are left alone.
    given = EngineConfig(device="cpu", cpu_bind="4-7")
    specs = launch.local_nodes("tcp://127.0.0.1:1", given, prefill=1, decode=1, insecure=True)
    assert [s.engine.cpu_bind for s in specs] == ["4-5", "6-7"]
    gpu = launch.local_nodes(
        "tcp://127.0.0.1:1", EngineConfig(device="cuda"), prefill=1, decode=1, insecure=True
    )
    assert [s.engine.cpu_bind for s in gpu] == [None, None]


def test_test_workers_take_disjoint_shares_of_the_host():
    """tests/worker_cores.py: each pytest-xdist worker (and what it starts) runs on its own cores."""
    from worker_cores import worker_share

    assert [worker_share((0, 1), f"gw{i}", 2) for i in range(2)] == [(0,), (1,)]
    assert [worker_share((0, 1, 2, 3), f"gw{i}", 2) for i in range(2)] == [(0, 1), (2, 3)]
    assert [worker_share((4, 5), f"gw{i}", 3) for i in range(3)] == [(4,), (5,), (4,)]
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    expected = (
        worker_share(host_cores(), worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        if worker
        else host_cores()
    )
    assert tuple(sorted(os.sched_getaffinity(0))) == expected
