"""`pdserve serve` and `pdserve coordinator`: the coordinator in this process, and, for serve, its
nodes as child processes; stops them all on Ctrl-C or SIGTERM, reloads the config on SIGHUP."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from pdserve import __version__
from pdserve.cluster import tracing
from pdserve.cluster.keys import ClusterKeys, default_key_dir
from pdserve.cluster.schema import validate
from pdserve.coordinator.api_server import build_app, default_model_names, listen_socket, serve_http
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.serving import OpenAIServing
from pdserve.engine.config import EngineConfig, RoleTensorParallel
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.tokenizer import Tokenizer
from pdserve.launch import NodeGroup, NodeSpec, local_nodes

logger = logging.getLogger("pdserve.serve")

# How long serve waits for the nodes it started to register (loading a model is most of it).
NODE_START_TIMEOUT_S = 600.0


@dataclass(slots=True)
class ServeOptions:
    model: str | None = None
    config_path: str | None = None
    prefill_nodes: int = 1
    decode_nodes: int = 1
    colocated: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    node_port: int = 0
    client_port: int | None = None
    start_nodes: bool = True
    log_dir: str | None = None
    drain_timeout_s: float = 30.0
    # Settings given as flags, over the config file's: EngineConfig, NodeOptions and
    # RoleTensorParallel (the nodes'), CoordinatorConfig (the coordinator's own).
    engine: dict[str, object] = field(default_factory=dict)
    node: dict[str, object] = field(default_factory=dict)
    roles: dict[str, object] = field(default_factory=dict)  # RoleTensorParallel
    coordinator: dict[str, object] = field(default_factory=dict)
    served_model_names: tuple[str, ...] = ()  # unset: the embedded model's or directory's name
    chat_template: str | None = None  # a template file instead of the model's
    # The cluster key set's directory (unset: the default one, made on first use), or insecure.
    cluster_keys: str | None = None
    insecure: bool = False
    api_keys: tuple[str, ...] = ()  # the HTTP API's keys (none: open)
    otlp_traces_endpoint: str | None = None  # where the coordinator and its nodes send spans
    http_log_level: str | None = None  # uvicorn's log level (unset: the process's)


def cluster_keys(options: ServeOptions) -> ClusterKeys | None:
    """The key set the coordinator's sockets admit and its nodes hold: the directory given (which
    must hold one), else the default directory's, made there on first use; None if insecure."""
    if options.insecure:
        if options.cluster_keys:
            raise ValueError("--insecure and --cluster-keys contradict each other: give one")
        logger.warning("--insecure: the coordinator's and nodes' sockets admit anyone, in clear")
        return None
    if options.cluster_keys:
        return ClusterKeys.load(options.cluster_keys)
    return ClusterKeys.load_or_create(default_key_dir())


def load_config(options: ServeOptions) -> CoordinatorConfig:
    """The coordinator's settings: flag over config file over default."""
    path = options.config_path
    config = CoordinatorConfig.from_toml(path) if path else CoordinatorConfig()
    for name, value in options.coordinator.items():
        setattr(config, name, value)
    validate(config)
    return config


def read_chat_template(path: str | None) -> str | None:
    """The text of a chat template file, checked to be a Jinja template."""
    if path is None:
        return None
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc.strerror}") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {path}, line {exc.lineno}: {exc.message}") from None
    return text


def node_engine(options: ServeOptions, config: CoordinatorConfig) -> EngineConfig:
    """Every node's engine settings: flag over config file over default."""
    return EngineConfig(**{"model": options.model, **config.node_settings.engine, **options.engine})


def node_specs(
    options: ServeOptions,
    config: CoordinatorConfig,
    coordinator_addr: str,
    keys: ClusterKeys | None = None,
) -> list[NodeSpec]:
    """The nodes serve starts; they hold `keys` (by its directory), or run insecure without, and
    send their spans where the coordinator does."""
    file = config.node_settings
    security: dict[str, object] = (
        {"insecure": True} if keys is None else {"cluster_keys": str(keys.directory)}
    )
    if options.otlp_traces_endpoint:
        security["otlp_traces_endpoint"] = options.otlp_traces_endpoint
    engine = node_engine(options, config)
    return local_nodes(
        coordinator_addr,
        engine,
        prefill=options.prefill_nodes,
        decode=options.decode_nodes,
        colocated=options.colocated,
        roles=node_roles(options, config),
        **{**file.node, **options.node, **security},
    )


def node_roles(options: ServeOptions, config: CoordinatorConfig) -> RoleTensorParallel:
    """Tensor-parallel sizes by role: flag over config file over tensor_parallel_size."""
    return RoleTensorParallel(**{**config.node_settings.roles, **options.roles})


async def serve_async(options: ServeOptions) -> int:
    """Serve until stopped; 0 after a clean stop, 1 if the coordinator failed (its supervisor,
    if any, restarts it)."""
    config = load_config(options)
    if options.start_nodes:
        node_specs(options, config, "tcp://127.0.0.1:0")  # a bad setting stops here, at once
    chat_template = read_chat_template(options.chat_template)
    keys = cluster_keys(options)
    names = options.served_model_names or default_model_names(options.model)
    client_addr = (
        None if options.client_port is None else f"tcp://{options.host}:{options.client_port}"
    )
    # Its own nodes reach it on loopback; others where its HTTP API listens (nothing listens
    # beyond loopback unless --host says so).
    node_host = "127.0.0.1" if options.start_nodes else options.host
    tracing.setup(options.otlp_traces_endpoint, "pdserve-coordinator")
    coordinator = Coordinator(
        config,
        node_addr=f"tcp://{node_host}:{options.node_port}",
        client_addr=client_addr,
        config_path=options.config_path,
        keys=keys,
    )
    # The HTTP port first: a busy port fails at once, before any node starts.
    http_sock = listen_socket(options.host, options.port)
    await coordinator.start()
    group = NodeGroup(Path(options.log_dir) if options.log_dir else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    def on_sigterm() -> None:
        # First SIGTERM drains (new requests get 503, running ones finish); a second stops now.
        if draining or coordinator.draining:
            stop.set()
            return
        coordinator.drain()

        async def drain_then_stop() -> None:
            finished = await coordinator.wait_drained(options.drain_timeout_s)
            logger.info("drain %s", "complete" if finished else "timed out")
            stop.set()

        draining.append(asyncio.create_task(drain_then_stop()))

    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGHUP, lambda: reload_config(coordinator, options))

    async def stop_on_failure() -> None:
        await coordinator.failed.wait()
        stop.set()

    watchdog = asyncio.create_task(stop_on_failure())
    try:
        if options.start_nodes:
            for spec in node_specs(options, config, coordinator.node_endpoint, keys):
                group.start(spec)
            wanted_prefill = 0 if options.colocated else options.prefill_nodes
            waiting = asyncio.create_task(
                coordinator.wait_for_nodes(
                    wanted_prefill, options.decode_nodes, timeout_s=NODE_START_TIMEOUT_S
                )
            )
            others = {asyncio.create_task(stop.wait()), asyncio.create_task(node_exited(group))}
            done, _ = await asyncio.wait({waiting, *others}, return_when=asyncio.FIRST_COMPLETED)
            for task in {waiting, *others} - done:
                task.cancel()
            if waiting in done:
                try:
                    waiting.result()
                except TimeoutError as exc:  # one line, as for a node that exits on its way
                    where = f"; their logs: {group.log_dir}" if group.log_dir else ""
                    raise ValueError(f"{exc}{where}") from None
            elif not stop.is_set():
                raise ValueError(next(iter(done)).result())
        if not stop.is_set():  # Ctrl-C while the nodes were starting: nothing to serve
            logger.info(
                "coordinator ready: nodes on %s, clients on %s, cluster keys %s",
                coordinator.node_endpoint,
                coordinator.client_endpoint or "-",
                keys.directory if keys else "none (insecure)",
            )
            print(f"pdserve: nodes connect to {coordinator.node_endpoint}", flush=True)
            await run_frontend(coordinator, options, names, chat_template, stop, http_sock)
    finally:
        watchdog.cancel()
        # Senders before receivers: no prefill node sees a decode node it sends to vanish.
        group.stop(roles=("prefill",))
        await coordinator.stop()
        group.stop()
        tracing.shutdown()  # the spans not yet exported go now
    if coordinator.failure is not None:
        logger.critical("exiting: %r", coordinator.failure)
        return 1
    return 0


async def node_exited(group: NodeGroup) -> str:
    """Returns (why) once a node has exited: before they all registered, that ends the start."""
    while True:
        for node_id, proc in group.procs.items():
            if proc.poll() is not None:
                where = f"; its log: {group.log_dir / (node_id + '.log')}" if group.log_dir else ""
                return f"node {node_id} exited ({proc.returncode}) before it registered{where}"
        await asyncio.sleep(0.2)


def reload_config(coordinator: Coordinator, options: ServeOptions) -> None:
    """SIGHUP: re-read the config file and apply its live settings; flags still win."""
    if options.config_path is None:
        logger.info("SIGHUP: no --config to re-read")
        return
    try:
        new = load_config(options)
    except ValueError as exc:
        logger.error("config not reloaded: %s", exc)
        return
    changed = coordinator.config.reload_from(new)
    fixed = coordinator.config.fixed_differences(new)
    logger.info("config reloaded: changed %s", changed or "nothing")
    if fixed:
        logger.warning("config fields %s need a restart to take effect", fixed)


async def run_frontend(
    coordinator: Coordinator,
    options: ServeOptions,
    names: tuple[str, ...],
    chat_template: str | None,
    stop: asyncio.Event,
    sock: socket.socket,
) -> None:
    """Serve the OpenAI-compatible HTTP API until asked to stop."""
    model_dir = resolve_model_dir(options.model)
    # Without --served-model-name, the model as it was given is a name for it too.
    aliases = () if options.served_model_names else tuple(filter(None, [options.model]))
    serving = OpenAIServing(
        coordinator,
        Tokenizer(model_dir, chat_template=chat_template),
        model_dir,
        names[0],
        aliases=names[1:] + aliases,
        listed=names,
    )
    app = build_app(serving, __version__, options.api_keys)
    # Stopping ends every open stream at once with an error event, and every whole response
    # under way with a 503, rather than letting uvicorn cut them after its grace period.
    await serve_http(
        app, sock, stop, log_level=options.http_log_level, on_stop=coordinator.cut_requests
    )


def run_serve(options: ServeOptions) -> int:
    return asyncio.run(serve_async(options))
