"""`pdserve launch`: the plan each example cluster file implies, bad files refused by key; the
Kubernetes manifests checked against the Kubernetes schema."""

from __future__ import annotations

import copy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.cluster.node_options import NodeOptions
from pdserve.cluster.schema import from_args
from pdserve.cluster_file import ClusterFileError, load_cluster_file, plan
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.engine.config import EngineConfig

REPO = Path(__file__).parent.parent
DEPLOY = REPO / "deploy"


def by_name(plans):
    return {p.name: p for p in plans}


def flag(plan, name: str) -> str:
    return plan.command[plan.command.index(name) + 1]


def engine(plan) -> EngineConfig:
    """The engine settings a node runs with: its command line parsed as `pdserve` parses it."""
    return from_args(EngineConfig, build_parser().parse_args(plan.command[3:]))


def node(plan) -> NodeOptions:
    return from_args(NodeOptions, build_parser().parse_args(plan.command[3:]))


def test_cpu_example_runs_everything_on_one_host():
    spec = load_cluster_file(DEPLOY / "cpu-local.toml")
    procs = by_name(plan(spec, "local"))
    assert sorted(procs) == [
        "pdserve-coordinator",
        "pdserve-decode-0",
        "pdserve-decode-1",
        "pdserve-prefill-0",
        "pdserve-prefill-1",
    ]
    assert procs["pdserve-coordinator"].ports == {"http": 8000, "nodes": 5555}
    for name in ("pdserve-decode-0", "pdserve-decode-1"):
        assert procs[name].transport == "tcp"
        assert "CUDA_VISIBLE_DEVICES" not in procs[name].env
        assert flag(procs[name], "--device") == "cpu"
    assert [procs[f"pdserve-decode-{i}"].ports["kv"] for i in (0, 1)] == [5700, 5701]
    assert flag(procs["pdserve-prefill-1"], "--coordinator") == "tcp://127.0.0.1:5555"
    assert flag(procs["pdserve-prefill-0"], "--max-num-batched-tokens") == "512"
    assert flag(procs["pdserve-decode-0"], "--max-num-seqs") == "128"
    decode = engine(procs["pdserve-decode-1"])
    assert (decode.dtype, decode.block_size, decode.num_kv_blocks) == ("float32", 16, 1024)
    assert node(procs["pdserve-decode-1"]).kv_port == 5701


def test_eight_gpu_host_pins_each_worker_and_uses_cuda_ipc():
    spec = load_cluster_file(DEPLOY / "gpu-8x-one-host.toml")
    procs = by_name(plan(spec, "gpu0"))
    gpus = {name: p.env.get("CUDA_VISIBLE_DEVICES") for name, p in procs.items()}
    assert gpus == {
        "pdserve-coordinator": None,
        **{f"pdserve-prefill-{i}": str(i) for i in range(4)},
        **{f"pdserve-decode-{i}": str(4 + i) for i in range(4)},
    }
    assert {procs[f"pdserve-decode-{i}"].transport for i in range(4)} == {"cuda_ipc"}
    assert flag(procs["pdserve-prefill-0"], "--gpu-memory-utilization") == "0.5"
    assert engine(procs["pdserve-decode-3"]).gpu_memory_utilization == 0.9
    assert engine(procs["pdserve-prefill-0"]).max_num_batched_tokens == 8192
    assert {engine(p).device for p in procs.values() if p.role != "coordinator"} == {"cuda"}


def test_two_hosts_split_roles_and_cross_with_nccl():
    spec = load_cluster_file(DEPLOY / "gpu-two-hosts.toml")
    prefill_host = by_name(plan(spec, "prefill-host"))
    decode_host = by_name(plan(spec, "decode-host"))
    assert "pdserve-coordinator" in prefill_host and "pdserve-coordinator" not in decode_host
    assert len([n for n in prefill_host if "prefill" in n]) == 8
    assert len(decode_host) == 8
    d7 = decode_host["pdserve-decode-7"]
    assert d7.transport == "nccl" and d7.env["CUDA_VISIBLE_DEVICES"] == "7"
    assert flag(d7, "--coordinator") == "tcp://10.0.0.1:5555"
    assert flag(d7, "--kv-host") == "10.0.0.2"


def test_llama3_70b_example_makes_tensor_parallel_nodes_of_contiguous_gpus():
    spec = load_cluster_file(DEPLOY / "llama3-70b-two-hosts.toml")
    prefill_host = by_name(plan(spec, "prefill-host"))
    decode_host = by_name(plan(spec, "decode-host"))
    prefill = [prefill_host[f"pdserve-prefill-{i}"] for i in (0, 1)]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in prefill] == ["0,1,2,3", "4,5,6,7"]
    assert {engine(p).tensor_parallel_size for p in prefill} == {4}
    assert sorted(decode_host) == ["pdserve-decode-0"]
    decode = decode_host["pdserve-decode-0"]
    assert decode.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert engine(decode).tensor_parallel_size == 8 and decode.transport == "nccl"


def test_tensor_parallel_cpu_workers_leave_room_for_each_ranks_kv_port(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(
        BASE.format(extra="decode_workers = 2\n[host.decode]\ntensor_parallel_size = 2")
    )
    decode = [p for p in plan(load_cluster_file(path), "a") if p.role == "decode"]
    assert [p.ports["kv"] for p in decode] == [5700, 5702]  # ranks 1 listen on 5701 and 5703
    assert [node(p).kv_port for p in decode] == [5700, 5702]


BASE = """
[[host]]
name = "a"
address = "127.0.0.1"
{extra}
"""


@pytest.mark.parametrize(
    "text,words",
    [
        (
            BASE.format(extra="decode_workers = 1\nprefil_workers = 1"),
            ["host 'a'", "prefil_workers"],
        ),
        (BASE.format(extra="decode_gpus = [0, 0]"), ["host 'a'", "decode_gpus"]),
        (BASE.format(extra="prefill_gpus = [1]\ndecode_gpus = [1]"), ["host 'a'", "decode_gpus"]),
        (
            BASE.format(extra="decode_workers = 1\ntransport = 'carrier-pigeon'"),
            ["host 'a'", "transport"],
        ),
        (
            BASE.format(extra="decode_workers = 1\n[host.decode]\nmax_num_seq = 3"),
            ["host 'a'", "max_num_seq"],
        ),
        (
            BASE.format(extra="decode_workers = 1\n[host.decode]\nmax_num_seqs = 0"),
            ["host 'a'", "[host.decode]", "max_num_seqs", ">= 1"],
        ),
        ("dtype = 'fp8'\n" + BASE.format(extra="decode_workers = 1"), ["dtype", "bfloat16"]),
        (
            BASE.format(extra="decode_workers = 1") + "[coordinator]\nhost = 'b'\n",
            ["coordinator", "host"],
        ),
        ('[[host]]\nname = "a"\ndecode_workers = 1\n', ["host 'a'", "address"]),
        (BASE.format(extra="prefill_workers = 1"), ["decode"]),
        (
            BASE.format(extra="decode_gpus = [0, 1, 2]\n[host.decode]\ntensor_parallel_size = 2"),
            ["host 'a'", "decode_gpus", "3 GPUs", "tensor_parallel_size = 2"],
        ),
    ],
)
def test_bad_cluster_files_are_refused_naming_the_key(tmp_path, text, words):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ClusterFileError) as err:
        load_cluster_file(path)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "text,words",
    [
        (
            BASE.format(extra="decode_workers = 1\n[coordinator]\ndrain_timeout_s = 'soon'"),
            ["[coordinator]", "key 'drain_timeout_s'", "must be a number", '"soon"'],
        ),
        (
            BASE.format(extra="decode_workers = 1\n[coordinator]\ndrain_timeout_s = -5"),
            ["[coordinator]", "key 'drain_timeout_s'", "must be >= 0", "-5"],
        ),
        (
            BASE.format(extra="decode_workers = 1\n[coordinator]\nhttp_port = 80000"),
            ["[coordinator]", "key 'http_port'", "<= 65535"],
        ),
        (
            "transport = 'udp'\n" + BASE.format(extra="decode_workers = 1"),
            ["key 'transport'", "one of auto, tcp, shm, cuda_ipc, nccl", '"udp"'],
        ),
        (
            BASE.format(extra="decode_workers = 1\ntransport = 'udp'"),
            ["host 'a'", "key 'transport'", "one of auto, tcp, shm, cuda_ipc, nccl", '"udp"'],
        ),
        (
            "colour = 'blue'\n" + BASE.format(extra="decode_workers = 1"),
            ["unknown key 'colour'", "known keys:", "model", "cluster_keys", "host"],
        ),
        (
            BASE.format(extra="decode_workers = 1\n[coordinator]\ncolour = 'blue'"),
            ["[coordinator]", "unknown key 'colour'", "http_port", "drain_timeout_s"],
        ),
        (
            BASE.format(extra="decode_workers = 1\ncolour = 'blue'"),
            ["host 'a'", "unknown key 'colour'", "decode_gpus", "kv_port_base"],
        ),
        (
            BASE.format(extra="decode_workers = 1\n[coordinator]\ndrain_timeout = 5"),
            ["[coordinator]", "unknown key 'drain_timeout'", "did you mean 'drain_timeout_s'"],
        ),
        (
            "max_num_seqs = 8\n" + BASE.format(extra="decode_workers = 1"),
            ["key 'max_num_seqs'", "[host.prefill] or [host.decode]"],
        ),
        (
            BASE.format(extra="decode_gpus = [0, -1]"),
            ["host 'a'", "key 'decode_gpus'", "every item must be >= 0", "-1"],
        ),
        (
            BASE.format(extra="decode_workers = 1.5"),
            ["host 'a'", "key 'decode_workers'", "an integer", "1.5"],
        ),
        (
            BASE.format(extra="decode_workers = 1\nkv_port_base = 0"),
            ["host 'a'", "key 'kv_port_base'", ">= 1"],
        ),
        (
            "insecure = 'yes'\n" + BASE.format(extra="decode_workers = 1"),
            ["key 'insecure'", "true or false"],
        ),
        (
            BASE.format(extra="decode_workers = 1\n[coordinator]\napi_key = ['a,b']"),
            ["[coordinator]", "key 'api_key'", "no commas"],
        ),
        (
            '[[host]]\nname = "a"\ndecode_workers = 1\n',
            ["host 'a'", "key 'address' is required", "how the other hosts reach this one"],
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_file_the_key_and_what_is_allowed(tmp_path, text, words):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ClusterFileError) as err:
        load_cluster_file(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for word in words:
        assert word in message


def test_a_single_api_key_or_a_list_of_them(tmp_path):
    path = tmp_path / "cluster.toml"
    for given, keys in (("'k'", ("k",)), ("['k1', 'k2']", ("k1", "k2"))):
        path.write_text(BASE.format(extra=f"decode_workers = 1\n[coordinator]\napi_key = {given}"))
        assert load_cluster_file(path).api_keys == keys


def test_the_docs_example_cluster_file_loads(tmp_path):
    doc = (REPO / "docs" / "deployment.md").read_text()
    path = tmp_path / "cluster.toml"
    path.write_text(doc.split("## The cluster file")[1].split("```toml\n")[1].split("```")[0])
    spec = load_cluster_file(path)
    assert (spec.coordinator_host, spec.drain_timeout_s, spec.api_keys) == ("gpu0", 30.0, ("KEY",))
    assert [p.name for p in plan(spec, "gpu0")][:2] == ["pdserve-coordinator", "pdserve-prefill-0"]


def test_launch_dry_run_prints_the_plan_and_starts_nothing():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "launch",
            str(DEPLOY / "gpu-two-hosts.toml"),
            "--host",
            "decode-host",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("CUDA_VISIBLE_DEVICES=") == 8
    assert "--transport nccl" in res.stdout
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "launch",
            str(DEPLOY / "llama3-70b-two-hosts.toml"),
            "--host",
            "prefill-host",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if "CUDA_VISIBLE_DEVICES=" in line]
    assert [line.split()[0] for line in lines] == [
        "CUDA_VISIBLE_DEVICES=0,1,2,3",
        "CUDA_VISIBLE_DEVICES=4,5,6,7",
    ]
    assert all("--tensor-parallel-size 4" in line for line in lines)


def test_launch_of_a_bad_file_is_one_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(BASE.format(extra="decode_gpus = 'all'"))
    res = subprocess.run(
        [sys.executable, "-m", "pdserve", "launch", str(path), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "decode_gpus" in res.stderr


# --- Kubernetes ---------------------------------------------------------------------------------

MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def manifest_objects(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kubernetes_errors(obj: dict) -> list[str]:
    """What the Kubernetes schema of the newest release kubernetes-validate ships finds wrong in
    one object, in strict mode (an unknown field is an error); none when it is valid."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    name = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{name}: {'.'.join(map(str, exc.path))}: {exc.message} (Kubernetes {version})"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{name}: {exc.message}"]
    return []


@pytest.fixture
def offline(monkeypatch):
    """No network: the schemas are the ones the package ships."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Kubernetes schema check tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_the_kubernetes_manifests_are_there():
    assert [p.name for p in MANIFESTS] == ["coordinator.yaml", "decode.yaml", "prefill.yaml"]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_each_kubernetes_manifest_is_valid_for_kubernetes(path, offline):
    objects = manifest_objects(path)
    assert objects
    errors = [error for obj in objects for error in kubernetes_errors(obj)]
    assert not errors, "\n".join(errors)


def test_a_broken_kubernetes_manifest_is_refused(offline):
    (decode, service) = manifest_objects(DEPLOY / "k8s" / "decode.yaml")
    container = decode["spec"]["template"]["spec"]["containers"][0]
    broken = []
    misspelt = copy.deepcopy(decode)
    misspelt["spec"]["template"]["spec"]["containers"][0]["resource"] = container["resources"]
    del misspelt["spec"]["template"]["spec"]["containers"][0]["resources"]
    broken.append((misspelt, "'resource' was unexpected"))
    wrong_type = copy.deepcopy(decode)
    wrong_type["spec"]["replicas"] = "four"
    broken.append((wrong_type, "'four' is not of type 'integer'"))
    no_selector = copy.deepcopy(decode)
    del no_selector["spec"]["selector"]
    broken.append((no_selector, "'selector' is a required property"))
    bad_port = copy.deepcopy(service)
    bad_port["spec"]["ports"] = [{"port": "http"}]
    broken.append((bad_port, "'http' is not of type 'integer'"))
    no_such_api = copy.deepcopy(decode)
    no_such_api["apiVersion"] = "apps/v9"
    broken.append((no_such_api, "Couldn't find schema for kind StatefulSet"))
    for obj, words in broken:
        (error,) = kubernetes_errors(obj)
        assert words in error


def test_the_kubernetes_commands_and_config_are_pdserves(tmp_path):
    """Each container's command parses as `pdserve` parses it, and the coordinator's ConfigMap
    holds a coordinator config that loads."""
    configs = 0
    for path in MANIFESTS:
        for obj in manifest_objects(path):
            if obj["kind"] == "ConfigMap":
                config = tmp_path / "pdserve.toml"
                config.write_text(obj["data"]["pdserve.toml"])
                assert CoordinatorConfig.from_toml(config).heartbeat_timeout_s == 5.0
                configs += 1
            if obj["kind"] in ("Deployment", "StatefulSet"):
                for container in obj["spec"]["template"]["spec"]["containers"]:
                    assert container["command"][0] == "pdserve"
                    build_parser().parse_args(container["command"][1:])
    assert configs == 1
