"""The cluster file (TOML) of `pdserve launch`: the model, the coordinator's place and ports, the
cluster's key set, and per host the GPUs (or CPU workers) given to prefill and to decode, with
each role's settings (`tensor_parallel_size` groups a role's GPUs into nodes of that many). Its
keys are settings declared here (`python -m pdserve.cluster_file` prints their table for
docs/deployment.md); `plan` turns a file into the processes one host runs: their commands,
environments and ports. No process is started here."""

from __future__ import annotations

import ipaddress
import shlex
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pdserve import cache_root
from pdserve.cluster.keys import default_key_dir
from pdserve.cluster.node_options import PLACEMENT, SECURITY, TRACING, NodeOptions
from pdserve.cluster.node_options import TRANSPORTS as NODE_TRANSPORTS
from pdserve.cluster.schema import (
    REQUIRED,
    check_required,
    declared,
    doc_rows,
    markdown_table,
    names,
    pick,
    read_table,
    setting,
    validate,
)
from pdserve.engine.config import EngineConfig
from pdserve.launch import NodeSpec, share_cores

T = TypeVar("T")
TRANSPORTS = ("auto", *NODE_TRANSPORTS)
# Engine settings every node of a cluster shares: the top of the file, not a role's table.
CLUSTER_WIDE = ("model", "dtype", "block_size", "kv_cache_dtype")
# What a role's table cannot set, and why.
NOT_PER_ROLE = {
    **{name: "set it at the top of the file: every node shares it" for name in CLUSTER_WIDE},
    "device": "launch picks cuda or cpu from the host's GPUs",
    "transport": "set it in [[host]] or at the top of the file",
    **{name: "launch gives each node its own" for name in PLACEMENT if name != "transport"},
    **{name: "set it at the top of the file: every process holds the same" for name in SECURITY},
    **{name: "set it at the top of the file: every process sends there" for name in TRACING},
}
# The engine settings the top of the file does not take, and why.
NOT_AT_TOP = {
    **{
        name: "set it in [host.prefill] or [host.decode]"
        for name in names(EngineConfig)
        if name not in CLUSTER_WIDE
    },
    "device": NOT_PER_ROLE["device"],
}
API_KEY_ENV = "PDSERVE_API_KEY"  # how launch hands the coordinator its API keys (not argv: ps)


class ClusterFileError(ValueError):
    """A cluster file that cannot be launched; the message names the file and the key (and host)."""


# --- the file's tables: one declaration per key -------------------------------------------------


@dataclass(slots=True)
class ClusterOptions:
    """The top of the file beside the engine's CLUSTER_WIDE settings: what launch does on every
    host. Paths are relative to the file."""

    log_dir: str | None = setting(
        None,
        "one log file per process in it (unset: a folder named as the file in ~/.cache/pdserve/logs)",
    )
    coordinator_config: str | None = setting(
        None, "the coordinator's config file (docs/configuration.md; unset: its defaults)"
    )
    transport: str = setting(
        "auto",
        "how decode nodes receive KV pages (auto: chosen per decode node)",
        choices=TRANSPORTS,
    )
    cluster_keys: str | None = setting(
        None,
        "the cluster key set (pdserve keygen DIR, copied to every host) every process holds; required when a host is off loopback (unset: the per-user set, made on first use)",
    )
    insecure: bool = setting(
        False,
        "no cluster keys: sockets admit anyone and carry everything in clear (a trusted network only)",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        "the OTLP collector every process sends its spans to, as `pdserve serve --otlp-traces-endpoint` takes it (unset: no tracing)",
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.cluster_keys == "":
            raise ValueError("key 'cluster_keys' must name a directory, got \"\"")
        if self.cluster_keys is not None and self.insecure:
            raise ValueError("keys 'cluster_keys' and 'insecure' contradict each other")


@dataclass(slots=True)
class CoordinatorPlace:
    """[coordinator]: the host that runs the coordinator, its ports, its drain, its API keys."""

    host: str | None = setting(None, "the [[host]] that runs it (unset: the first)")
    http_port: int = setting(8000, "the HTTP API's port", minimum=1, maximum=65535)
    node_port: int = setting(5555, "the port nodes connect to", minimum=1, maximum=65535)
    client_port: int | None = setting(
        None, "the Python client's socket (unset: none)", minimum=1, maximum=65535
    )
    drain_timeout_s: float = setting(
        30.0, "on SIGTERM, how long running requests get to finish", minimum=0
    )
    api_key: tuple[str, ...] | None = setting(
        None,
        "the HTTP API's key, or a list of keys, handed to the coordinator in its environment (unset: the API is open)",
    )

    def __post_init__(self) -> None:
        validate(self)
        keys = self.api_key
        if keys is not None and not (keys and all(k and "," not in k for k in keys)):
            raise ValueError("key 'api_key' must be a key or a list of keys (non-empty, no commas)")


@dataclass(slots=True)
class HostSpec:
    """[[host]]: one machine of the cluster and the nodes launch starts on it."""

    name: str = setting(REQUIRED, "the host's name, as `pdserve launch --host NAME` gives it")
    address: str = setting(REQUIRED, "how the other hosts reach this one (its IP or name)")
    prefill_gpus: tuple[int, ...] = setting(
        (), "GPUs of prefill nodes, [host.prefill] tensor_parallel_size per node", minimum=0
    )
    decode_gpus: tuple[int, ...] = setting(
        (), "GPUs of decode nodes, [host.decode] tensor_parallel_size per node", minimum=0
    )
    prefill_workers: int = setting(0, "CPU prefill nodes, instead of prefill_gpus", minimum=0)
    decode_workers: int = setting(0, "CPU decode nodes, instead of decode_gpus", minimum=0)
    transport: str | None = setting(
        None,
        "how this host's decode nodes receive KV pages (unset: the top's transport)",
        choices=TRANSPORTS,
    )
    kv_port_base: int = setting(
        5700,
        "decode node i of this host receives KV on kv_port_base + i × its tensor_parallel_size",
        minimum=1,
        maximum=65535,
    )
    # Per-role settings of EngineConfig and NodeOptions ([host.prefill], [host.decode]), checked,
    # by their current names.
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)
        for key in ("name", "address"):
            if not getattr(self, key):
                raise ValueError(f"key '{key}' must not be empty")
        for role in ("prefill", "decode"):
            gpus, size = getattr(self, f"{role}_gpus"), self.tensor_parallel_size(role)
            if len(set(gpus)) != len(gpus):
                raise ValueError(f"key '{role}_gpus' names a GPU twice: {list(gpus)}")
            if len(gpus) % size:
                raise ValueError(
                    f"key '{role}_gpus' names {len(gpus)} GPUs, not a multiple of "
                    f"[host.{role}] tensor_parallel_size = {size}"
                )
        overlap = set(self.prefill_gpus) & set(self.decode_gpus)
        if overlap:
            raise ValueError(f"key 'decode_gpus' reuses prefill GPU {sorted(overlap)[0]}")

    def tensor_parallel_size(self, role: str) -> int:
        """Devices (processes) per node of this role: its table's tensor_parallel_size."""
        settings = self.prefill if role == "prefill" else self.decode
        return settings.get("tensor_parallel_size", 1)

    def gpu_groups(self, role: str) -> list[tuple[int, ...]]:
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


# Keys that hold tables, read apart from the settings beside them.
TABLES = {ClusterOptions: ("coordinator", "host"), HostSpec: ("prefill", "decode")}


def doc_table() -> str:
    """The table of docs/deployment.md: every key of a cluster file, by the table it goes in."""
    rows = []
    for table, cls, only in (
        ("top", EngineConfig, CLUSTER_WIDE),
        ("top", ClusterOptions, None),
        ("`[coordinator]`", CoordinatorPlace, None),
        ("`[[host]]`", HostSpec, None),
    ):
        choices = {d.name: d.spec.choices for d in declared(cls) if d.spec.choices}
        for key, default, _, meaning in doc_rows(cls, only):
            if key in choices:
                meaning += f"; one of {', '.join(map(str, choices[key]))}"
            rows.append((table, f"`{key}`", default, meaning))
    refused = ", ".join(f"`{name}`" for name in NOT_PER_ROLE)
    rows.append(
        (
            "`[host.prefill]`, `[host.decode]`",
            "a node setting",
            "its default",
            f"any key that configuration.md marks restart, but {refused}",
        )
    )
    return markdown_table(("table", "key", "default", "meaning"), rows)


# --- the file, checked --------------------------------------------------------------------------


@dataclass(slots=True)
class ClusterSpec:
    """A checked cluster file: its hosts, and what every host's launch takes from it (the
    defaults are the declarations' above)."""

    path: Path
    hosts: list[HostSpec]
    coordinator_host: str
    http_port: int
    node_port: int
    client_port: int | None
    drain_timeout_s: float
    api_keys: tuple[str, ...]
    engine: dict[str, Any]  # the CLUSTER_WIDE settings given
    transport: str
    insecure: bool
    cluster_keys: Path | None  # the key set's directory (unset: the per-user default)
    log_dir: Path | None
    coordinator_config: Path | None
    otlp_traces_endpoint: str | None = None

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


def load_cluster_file(path: str | Path) -> ClusterSpec:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ClusterFileError(f"cluster file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ClusterFileError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return _checked(path, data)
    except ClusterFileError:
        raise
    except ValueError as exc:  # every message names the file already
        raise ClusterFileError(str(exc)) from exc


def _made(cls: type[T], values: Mapping[str, Any], where: str, **given: Any) -> T:
    """cls of values read_table checked; what its own checks refuse is named after `where`."""
    try:
        return cls(**values, **given)
    except ValueError as exc:
        raise ValueError(f"{where}{exc}") from exc


def _checked(path: Path, data: dict[str, Any]) -> ClusterSpec:
    at = f"{path}: "
    own, engine = read_table(
        data,
        ClusterOptions,
        EngineConfig,
        where=at,
        refuse=NOT_AT_TOP,
        tables=TABLES[ClusterOptions],
        list_known=True,
    )
    options = _made(ClusterOptions, own, at)
    raw_hosts = data.get("host")
    if not (
        isinstance(raw_hosts, list) and raw_hosts and all(isinstance(h, dict) for h in raw_hosts)
    ):
        raise ValueError(f"{at}key 'host' must list at least one [[host]] table")
    hosts: list[HostSpec] = []
    for index, raw in enumerate(raw_hosts):
        hosts.append(_host(path, index, raw, hosts, engine))
    raw_place = data.get("coordinator", {})
    if not isinstance(raw_place, dict):
        raise ValueError(f"{at}key 'coordinator' must be a table")
    where = f"{at}[coordinator] "
    if isinstance(raw_place.get("api_key"), str):  # one key may be written alone
        raw_place = {**raw_place, "api_key": [raw_place["api_key"]]}
    (values,) = read_table(raw_place, CoordinatorPlace, where=where, list_known=True)
    place = _made(CoordinatorPlace, values, where)
    coordinator_host = hosts[0].name if place.host is None else place.host
    if coordinator_host not in {h.name for h in hosts}:
        raise ValueError(f"{where}key 'host' names no host: {coordinator_host!r}")
    spec = ClusterSpec(
        path=path,
        hosts=hosts,
        coordinator_host=coordinator_host,
        http_port=place.http_port,
        node_port=place.node_port,
        client_port=place.client_port,
        drain_timeout_s=place.drain_timeout_s,
        api_keys=place.api_key or (),
        engine=engine,
        transport=options.transport,
        insecure=options.insecure,
        cluster_keys=_beside(path, options.cluster_keys, expand=True),
        log_dir=_beside(path, options.log_dir),
        coordinator_config=_beside(path, options.coordinator_config),
        otlp_traces_endpoint=options.otlp_traces_endpoint,
    )
    far = spec.off_loopback
    if far is not None and spec.cluster_keys is None and not spec.insecure:
        raise ValueError(
            f"{at}host {far.name!r} is at {far.address}, not loopback, and the file names no "
            "cluster keys: make a key set with `pdserve keygen DIR`, copy DIR to every host and "
            'add `cluster_keys = "DIR"` at the top of the file (or, on a trusted network only, '
            "`insecure = true`; see docs/security.md)"
        )
    if not any(h.num_decode for h in hosts):
        raise ValueError(f"{at}no host has decode GPUs or decode workers")
    if len({h.has_gpus for h in hosts if h.num_prefill or h.num_decode}) > 1:
        raise ValueError(f"{at}hosts mix GPUs and CPU workers; give all GPUs or all CPU workers")
    return spec


def _host(
    path: Path, index: int, raw: dict[str, Any], before: list[HostSpec], engine: dict[str, Any]
) -> HostSpec:
    """The index-th [[host]] table, checked (`engine`: the top's CLUSTER_WIDE settings)."""
    name = raw.get("name")
    where = f"{path}: " + (f"host {name!r}: " if isinstance(name, str) else f"host #{index + 1}: ")
    (values,) = read_table(raw, HostSpec, where=where, tables=TABLES[HostSpec], list_known=True)
    check_required(HostSpec, values, where)
    if any(h.name == values["name"] for h in before):
        raise ValueError(f"{where}key 'name' repeats another host's name")
    roles: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode"):
        if f"{role}_gpus" in raw and f"{role}_workers" in raw:
            raise ValueError(f"{where}key '{role}_workers' conflicts with '{role}_gpus': give one")
        if role in raw:
            table = raw[role]
            if not isinstance(table, dict):
                raise ValueError(f"{where}key '{role}' must be a table of settings")
            settings = read_table(
                table,
                EngineConfig,
                NodeOptions,
                where=f"{where}[host.{role}] ",
                refuse=NOT_PER_ROLE,
            )
            roles[role] = {**settings[0], **settings[1]}
    host = _made(HostSpec, values, where, **roles)
    for role in ("prefill", "decode"):  # the checks that span settings, before any process starts
        settings = pick(EngineConfig, getattr(host, role))
        _made(EngineConfig, {**engine, **settings}, f"{where}[host.{role}] ")
    return host


def _beside(path: Path, given: str | None, expand: bool = False) -> Path | None:
    """A path the file gives, relative to the file's folder."""
    if given is None:
        return None
    return (path.parent / (Path(given).expanduser() if expand else given)).resolve()


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
        lines = [
            f"{self.name}  ({self.role}; ports: {ports}"
            + (f"; transport: {self.transport}" if self.transport else "")
            + ")",
            f"  {env + ' ' if env else ''}{shlex.join(self.command)}",
        ]
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
    tracing = (
        {"otlp_traces_endpoint": spec.otlp_traces_endpoint} if spec.otlp_traces_endpoint else {}
    )
    if spec.coordinator_host == host.name:
        cmd = python + [
            "coordinator",
            "--host",
            host.address,
            "--port",
            str(spec.http_port),
            "--node-port",
            str(spec.node_port),
        ]
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
        if spec.otlp_traces_endpoint:
            cmd += ["--otlp-traces-endpoint", spec.otlp_traces_endpoint]
        env = {API_KEY_ENV: ",".join(spec.api_keys)} if spec.api_keys else {}
        procs.append(ProcessPlan("pdserve-coordinator", "coordinator", cmd, env, ports))
    nodes: list[tuple[NodeSpec, dict[str, int], str | None]] = []
    for role in ("prefill", "decode"):
        groups = host.gpu_groups(role)
        count = host.num_prefill if role == "prefill" else host.num_decode
        settings = host.prefill if role == "prefill" else host.decode
        engine = EngineConfig(
            **spec.engine, device="cuda" if groups else "cpu", **pick(EngineConfig, settings)
        )
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
            options = NodeOptions(**placement, **security, **tracing, **pick(NodeOptions, settings))
            nodes.append((NodeSpec(role, options, engine, env), ports, transport))
    share_cores([node for node, _, _ in nodes])
    for node, ports, transport in nodes:
        procs.append(
            ProcessPlan(
                f"pdserve-{node.node_id}", node.role, node.command(), node.env, ports, transport
            )
        )
    return procs


if __name__ == "__main__":
    print(doc_table(), end="")  # python -m pdserve.cluster_file: the table of docs/deployment.md
