"""The cluster file (TOML) of `pdserve launch`: the model, the coordinator's place and ports, the
cluster's key set, and per host the GPUs (or CPU workers) given to prefill and to decode, with
each role's settings (`tensor_parallel_size` groups a role's GPUs into nodes of that many). `plan`
turns it into the processes one host runs: their commands, environments and ports. No process is
started here."""

from __future__ import annotations

import ipaddress
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import cache_root
from pdserve.cluster.keys import default_key_dir
from pdserve.cluster.node_options import PLACEMENT, SECURITY, NodeOptions
from pdserve.cluster.node_options import TRANSPORTS as NODE_TRANSPORTS
from pdserve.cluster.schema import pick, read_table
from pdserve.engine.config import EngineConfig
from pdserve.launch import NodeSpec, share_cores

TRANSPORTS = ("auto", *NODE_TRANSPORTS)
# Engine settings every node of a cluster shares: the top of the file, not a role's table.
CLUSTER_WIDE = ("model", "dtype", "block_size")
# What a role's table cannot set, and why.
NOT_PER_ROLE = {
    **{name: "set it at the top of the file: every node shares it" for name in CLUSTER_WIDE},
    "device": "launch picks cuda or cpu from the host's GPUs",
    "transport": "set it in [[host]] or at the top of the file",
    **{name: "launch gives each node its own" for name in PLACEMENT if name != "transport"},
    **{name: "set it at the top of the file: every process holds the same" for name in SECURITY},
}
TOP_KEYS = {"log_dir", "coordinator_config", "transport", "coordinator", "host", *CLUSTER_WIDE,
            *SECURITY}  # fmt: skip
COORDINATOR_KEYS = {"host", "http_port", "node_port", "client_port", "drain_timeout_s", "api_key"}
API_KEY_ENV = "PDSERVE_API_KEY"  # how launch hands the coordinator its API keys (not argv: ps)
HOST_KEYS = {"name", "address", "prefill_gpus", "decode_gpus", "prefill_workers",
             "decode_workers", "transport", "kv_port_base", "prefill", "decode"}  # fmt: skip


class ClusterFileError(ValueError):
    """A cluster file that cannot be launched; the message names the key (and host)."""


@dataclass(slots=True)
class HostSpec:
    name: str
    address: str
    prefill_gpus: list[int] = field(default_factory=list)
    decode_gpus: list[int] = field(default_factory=list)
    prefill_workers: int = 0  # CPU workers, when no GPUs are given
    decode_workers: int = 0
    transport: str | None = None
    kv_port_base: int = 5700
    # Per-role settings of EngineConfig and NodeOptions, checked, by their current names.
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)

    def tensor_parallel_size(self, role: str) -> int:
        """Devices (processes) per node of this role: its table's tensor_parallel_size."""
        settings = self.prefill if role == "prefill" else self.decode
        return settings.get("tensor_parallel_size", 1)

    def gpu_groups(self, role: str) -> list[list[int]]:
        """Each node's GPUs: contiguous groups of tensor_parallel_size, in the order given."""
        gpus = self.prefill_gpus if role == "prefill" else self.decode_gpus
        size = self.tensor_parallel_size(role)
        return [gpus[i : i + size] for i in range(0, len(gpus), size)]

    @property
    def num_prefill(self) -> int:
        return len(self.gpu_groups("prefill")) or self.prefill_workers

    @property
    def num_decode(self) -> int:
        return len(self.gpu_groups("decode")) or self.decode_workers

    @property
    def has_gpus(self) -> bool:
        return bool(self.prefill_gpus or self.decode_gpus)


@dataclass(slots=True)
class ClusterSpec:
    path: Path
    hosts: list[HostSpec]
    coordinator_host: str
    http_port: int = 8000
    node_port: int = 5555
    client_port: int | None = None
    drain_timeout_s: float = 30.0
    engine: dict[str, Any] = field(default_factory=dict)  # the CLUSTER_WIDE settings given
    log_dir: Path | None = None
    coordinator_config: Path | None = None
    transport: str = "auto"
    cluster_keys: Path | None = None  # the key set's directory (unset: the per-user default)
    insecure: bool = False
    api_keys: tuple[str, ...] = ()

    @property
    def model(self) -> str | None:
        return self.engine.get("model")

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ClusterFileError(
            f"{self.path}: no host named {name!r} (hosts: {[h.name for h in self.hosts]})"
        )

    @property
    def node_counts(self) -> dict[str, int]:
        """The cluster's nodes of each role, over every host."""
        prefill = sum(h.num_prefill for h in self.hosts)
        return {"prefill": prefill, "decode": sum(h.num_decode for h in self.hosts)}

    @property
    def coordinator_address(self) -> str:
        return self.host(self.coordinator_host).address

    @property
    def off_loopback(self) -> HostSpec | None:
        """A host whose address is not loopback (the cluster's sockets face a network), if any."""
        return next((h for h in self.hosts if not is_loopback(h.address)), None)

    def decode_transport(self, host: HostSpec) -> str:
        """The transport a decode node on `host` receives with: cuda_ipc within a GPU host,
        nccl across GPU hosts, shm within a CPU host, tcp across CPU hosts; unless set."""
        chosen = host.transport or self.transport
        if chosen != "auto":
            return chosen
        prefill_hosts = {h.name for h in self.hosts if h.num_prefill}
        local = prefill_hosts <= {host.name}
        if host.decode_gpus:
            return "cuda_ipc" if local else "nccl"
        return "shm" if local else "tcp"


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _fail(path: Path, where: str, message: str) -> ClusterFileError:
    return ClusterFileError(f"{path}: {where}{message}")


def _check_keys(path: Path, table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(path, where, f"unknown key '{unknown[0]}'")


def _int_list(path: Path, where: str, key: str, value: object) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise _fail(path, where, f"key '{key}' must be a list of GPU indexes, got {value!r}")
    if len(set(value)) != len(value):
        raise _fail(path, where, f"key '{key}' names a GPU twice: {value!r}")
    return list(value)


def _positive_int(path: Path, where: str, key: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _fail(path, where, f"key '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _overrides(path: Path, where: str, role: str, table: object) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _fail(path, where, f"key '{role}' must be a table of settings")
    try:
        where = f"{path}: {where}[host.{role}] "
        engine, node = read_table(
            table, EngineConfig, NodeOptions, where=where, refuse=NOT_PER_ROLE
        )
    except ValueError as exc:
        raise ClusterFileError(str(exc)) from exc
    return {**engine, **node}


def load_cluster_file(path: str | Path) -> ClusterSpec:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ClusterFileError(f"cluster file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ClusterFileError(f"{path}: not valid TOML: {exc}") from exc
    _check_keys(path, data, TOP_KEYS, "")
    raw_hosts = data.get("host")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise _fail(path, "", "key 'host' must list at least one [[host]] table")
    hosts: list[HostSpec] = []
    for index, raw in enumerate(raw_hosts):
        name = raw.get("name")
        where = f"host {name!r}: " if isinstance(name, str) else f"host #{index + 1}: "
        if not isinstance(name, str) or not name:
            raise _fail(path, where, "key 'name' is required")
        if any(h.name == name for h in hosts):
            raise _fail(path, where, "key 'name' repeats another host's name")
        _check_keys(path, raw, HOST_KEYS, where)
        address = raw.get("address")
        if not isinstance(address, str) or not address:
            raise _fail(path, where, "key 'address' is required (the host's reachable IP or name)")
        host = HostSpec(name=name, address=address)
        for role in ("prefill", "decode"):
            gpus_key, workers_key = f"{role}_gpus", f"{role}_workers"
            if gpus_key in raw and workers_key in raw:
                raise _fail(
                    path, where, f"key '{workers_key}' conflicts with '{gpus_key}': give one"
                )
            if gpus_key in raw:
                setattr(host, gpus_key, _int_list(path, where, gpus_key, raw[gpus_key]))
            if workers_key in raw:
                setattr(
                    host, workers_key, _positive_int(path, where, workers_key, raw[workers_key])
                )
            if role in raw:
                setattr(host, role, _overrides(path, where, role, raw[role]))
        for role in ("prefill", "decode"):
            gpus, size = getattr(host, f"{role}_gpus"), host.tensor_parallel_size(role)
            if len(gpus) % size:
                raise _fail(
                    path, where, f"key '{role}_gpus' names {len(gpus)} GPUs, not a multiple of "
                    f"[host.{role}] tensor_parallel_size = {size}",
                )  # fmt: skip
        overlap = set(host.prefill_gpus) & set(host.decode_gpus)
        if overlap:
            raise _fail(path, where, f"key 'decode_gpus' reuses prefill GPU {sorted(overlap)[0]}")
        if "transport" in raw:
            if raw["transport"] not in TRANSPORTS:
                raise _fail(
                    path,
                    where,
                    f"key 'transport' must be one of {TRANSPORTS}, got {raw['transport']!r}",
                )
            host.transport = raw["transport"]
        if "kv_port_base" in raw:
            host.kv_port_base = _positive_int(path, where, "kv_port_base", raw["kv_port_base"], 1)
        hosts.append(host)
    coordinator = data.get("coordinator", {})
    if not isinstance(coordinator, dict):
        raise _fail(path, "", "key 'coordinator' must be a table")
    _check_keys(path, coordinator, COORDINATOR_KEYS, "[coordinator] ")
    coordinator_host = coordinator.get("host", hosts[0].name)
    if coordinator_host not in {h.name for h in hosts}:
        raise _fail(path, "[coordinator] ", f"key 'host' names no host: {coordinator_host!r}")
    spec = ClusterSpec(path=path, hosts=hosts, coordinator_host=coordinator_host)
    for key in ("http_port", "node_port", "client_port"):
        if key in coordinator:
            setattr(spec, key, _positive_int(path, "[coordinator] ", key, coordinator[key], 1))
    if "drain_timeout_s" in coordinator:
        spec.drain_timeout_s = float(coordinator["drain_timeout_s"])
    if "api_key" in coordinator:
        keys = coordinator["api_key"]
        keys = [keys] if isinstance(keys, str) else keys
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k and
                                                               "," not in k for k in keys):  # fmt: skip
            raise _fail(path, "[coordinator] ", "key 'api_key' must be a key or a list of keys "
                        "(non-empty, no commas)")  # fmt: skip
        spec.api_keys = tuple(keys)
    _read_security(spec, data)
    if "transport" in data:
        if data["transport"] not in TRANSPORTS:
            raise _fail(
                path, "", f"key 'transport' must be one of {TRANSPORTS}, got {data['transport']!r}"
            )
        spec.transport = data["transport"]
    try:
        (spec.engine,) = read_table(
            {k: v for k, v in data.items() if k in CLUSTER_WIDE}, EngineConfig, where=f"{path}: "
        )
        for host in hosts:  # the checks that span settings, before any process starts
            EngineConfig(**spec.engine, **pick(EngineConfig, host.prefill))
            EngineConfig(**spec.engine, **pick(EngineConfig, host.decode))
    except ValueError as exc:
        raise ClusterFileError(str(exc)) from exc
    if "log_dir" in data:
        spec.log_dir = (path.parent / data["log_dir"]).resolve()
    if "coordinator_config" in data:
        spec.coordinator_config = (path.parent / data["coordinator_config"]).resolve()
    if not any(h.num_decode for h in hosts):
        raise _fail(path, "", "no host has decode GPUs or decode workers")
    gpu_hosts = {h.has_gpus for h in hosts if h.num_prefill or h.num_decode}
    if len(gpu_hosts) > 1:
        raise _fail(path, "", "hosts mix GPUs and CPU workers; give all GPUs or all CPU workers")
    return spec


def _read_security(spec: ClusterSpec, data: dict) -> None:
    path = spec.path
    if "insecure" in data:
        if not isinstance(data["insecure"], bool):
            raise _fail(path, "", f"key 'insecure' must be true or false, got {data['insecure']!r}")
        spec.insecure = data["insecure"]
    if "cluster_keys" in data:
        if not isinstance(data["cluster_keys"], str) or not data["cluster_keys"]:
            raise _fail(path, "", "key 'cluster_keys' must be a directory")
        if spec.insecure:
            raise _fail(path, "", "keys 'cluster_keys' and 'insecure' contradict each other")
        spec.cluster_keys = (path.parent / Path(data["cluster_keys"]).expanduser()).resolve()
    far = spec.off_loopback
    if far is not None and spec.cluster_keys is None and not spec.insecure:
        raise _fail(
            path, "",
            f"host {far.name!r} is at {far.address}, not loopback, and the file names no cluster "
            "keys: make a key set with `pdserve keygen DIR`, copy DIR to every host and add "
            "`cluster_keys = \"DIR\"` at the top of the file (or, on a trusted network only, "
            "`insecure = true`; see docs/security.md)",
        )  # fmt: skip


def key_dir(spec: ClusterSpec) -> Path:
    """Where the cluster's key set is: the file's cluster_keys, else (a cluster on loopback) the
    per-user default directory, which launch makes on first use."""
    return spec.cluster_keys or default_key_dir()


def log_dir(spec: ClusterSpec) -> Path:
    """Where this cluster's processes log: the file's log_dir, else pdserve's cache folder
    (`~/.cache/pdserve/logs/<cluster file's name>`), never beside the file (a repository)."""
    return spec.log_dir or cache_root() / "logs" / spec.path.stem


# --- the plan -----------------------------------------------------------------------------------


@dataclass(slots=True)
class ProcessPlan:
    name: str  # also its process title and log file name
    role: str  # coordinator | prefill | decode
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    transport: str | None = None

    def describe(self) -> str:
        env = " ".join(f"{k}={'***' if k == API_KEY_ENV else v}" for k, v in self.env.items())
        ports = ", ".join(f"{k} {v}" for k, v in self.ports.items()) or "-"
        lines = [f"{self.name}  ({self.role}; ports: {ports}"
                 + (f"; transport: {self.transport}" if self.transport else "") + ")",
                 f"  {env + ' ' if env else ''}{shlex.join(self.command)}"]  # fmt: skip
        return "\n".join(lines)


def _global_index(spec: ClusterSpec, host: HostSpec, role: str) -> int:
    """Nodes are numbered across the cluster, in host order."""
    before = 0
    for h in spec.hosts:
        if h.name == host.name:
            return before
        before += h.num_prefill if role == "prefill" else h.num_decode
    raise AssertionError(host.name)


def plan(spec: ClusterSpec, host_name: str) -> list[ProcessPlan]:
    host = spec.host(host_name)
    python = [sys.executable, "-m", "pdserve"]
    procs: list[ProcessPlan] = []
    coordinator = f"tcp://{spec.coordinator_address}:{spec.node_port}"
    security = {"insecure": True} if spec.insecure else {"cluster_keys": str(key_dir(spec))}
    if spec.coordinator_host == host.name:
        cmd = python + ["coordinator", "--host", host.address, "--port", str(spec.http_port),
                        "--node-port", str(spec.node_port)]  # fmt: skip
        ports = {"http": spec.http_port, "nodes": spec.node_port}
        if spec.client_port:
            cmd += ["--client-port", str(spec.client_port)]
            ports["clients"] = spec.client_port
        if spec.coordinator_config:
            cmd += ["--config", str(spec.coordinator_config)]
        if spec.model:
            cmd += ["--model", spec.model]
        cmd += ["--drain-timeout", str(spec.drain_timeout_s)]
        cmd += ["--insecure"] if spec.insecure else ["--cluster-keys", security["cluster_keys"]]
        env = {API_KEY_ENV: ",".join(spec.api_keys)} if spec.api_keys else {}
        procs.append(ProcessPlan("pdserve-coordinator", "coordinator", cmd, env, ports))
    nodes: list[tuple[NodeSpec, dict[str, int], str | None]] = []
    for role in ("prefill", "decode"):
        groups = host.gpu_groups(role)
        count = host.num_prefill if role == "prefill" else host.num_decode
        settings = host.prefill if role == "prefill" else host.decode
        engine = EngineConfig(**spec.engine, device="cuda" if groups else "cpu",
                              **pick(EngineConfig, settings))  # fmt: skip
        size = engine.tensor_parallel_size
        first = _global_index(spec, host, role)
        for local in range(count):
            index = first + local
            placement: dict[str, Any] = {"coordinator": coordinator, "node_id": f"{role}-{index}"}
            # A node's ranks see its GPUs alone, as cuda:0 .. cuda:N-1.
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, groups[local]))} if groups else {}
            ports: dict[str, int] = {}
            transport = None
            if role == "decode":
                transport = spec.decode_transport(host)
                # Rank r of a node receives on kv + r: the next node's ports start after.
                ports["kv"] = host.kv_port_base + local * size
                placement.update(transport=transport, kv_host=host.address, kv_port=ports["kv"])
            options = NodeOptions(**placement, **security, **pick(NodeOptions, settings))
            nodes.append((NodeSpec(role, options, engine, env), ports, transport))
    share_cores([node for node, _, _ in nodes])
    for node, ports, transport in nodes:
        procs.append(ProcessPlan(f"pdserve-{node.node_id}", node.role, node.command(), node.env,
                                 ports, transport))  # fmt: skip
    return procs
