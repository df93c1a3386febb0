"""The `pdserve` command: parses arguments and hands off to the parts; no logic of its own."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import re
import signal
import sys
import time
from pathlib import Path

from pdserve import __version__
from pdserve.cluster.node_options import PLACEMENT, SECURITY, TRACING, NodeOptions
from pdserve.cluster.schema import add_flags, from_args, names, values_from_args
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.engine.config import EngineConfig, RoleTensorParallel
from pdserve.engine.embedded.catalog import EMBEDDED
from pdserve.tune.command import DESCRIPTION as TUNE_DESCRIPTION
from pdserve.tune.command import add_arguments as add_tune_arguments
from pdserve.vllm_flags import add_vllm_flags, apply_vllm_flags

DESCRIPTION = (
    "pdserve serves open-weight LLMs (Hugging Face checkpoints of the Llama, Mistral, Qwen2 and "
    "Qwen3 families) behind an OpenAI-compatible HTTP API, with prefill and decode on separate "
    "worker processes: `pdserve serve [MODEL]` starts everything on this machine, `pdserve "
    "launch CLUSTER.toml` one host's part of a cluster. With no MODEL it serves pdserve-stories, a "
    "small embedded model that writes simple stories (or $PDSERVE_MODEL). pdserve never downloads "
    "a model: MODEL is a local directory."
)

# Node settings that serve's flags may set: where a node sits in the cluster is serve's to give.
SERVE_NODE_FLAGS = tuple(
    n
    for n in names(NodeOptions)
    if (n not in PLACEMENT or n == "transport") and n not in SECURITY + TRACING
)
# The coordinator's own settings offered as flags too (vLLM users expect this one on the command
# line); every other one is a key of --config.
SERVE_COORDINATOR_FLAGS = (
    "max_pending_requests",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "reasoning_parser",
)
# A Hugging Face hub id: ORG/NAME, nothing else in it.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help line ends with its default, once (settings' help already has it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False
        if "default" in text or not action.option_strings or unset:
            return text
        if action.default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def check_model(model: str | None) -> None:
    """A model is an embedded one or a local checkpoint directory; a hub id gets told how to
    fetch it."""
    if model is None or model in EMBEDDED:
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{model} has no config.json: not a Hugging Face checkpoint")
        return
    if HUB_ID.fullmatch(model) and not model.startswith("."):
        raise ValueError(
            f"model {model!r} is not a local directory, and pdserve never downloads: fetch it "
            f"with `hf download {model} --local-dir DIR`, then give DIR"
        )
    raise ValueError(f"model directory {model!r} does not exist")


def _model_arg(args: argparse.Namespace) -> str | None:
    """The model given as MODEL or --model (not both, unless they agree)."""
    positional, flag = getattr(args, "model_arg", None), getattr(args, "model", None)
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"two models given: {positional!r} and --model {flag!r}; give one")
    model = positional if positional is not None else flag
    check_model(model)
    if model is None or model in EMBEDDED:
        return model
    return str(Path(model).expanduser())


def escape_controls(text: str) -> str:
    """Control characters (but newline and tab) as Python escapes, for a terminal."""
    return "".join(
        c if c in "\n\t" or (c.isprintable() and c != "\x7f") else repr(c)[1:-1] for c in text
    )


def _generate(args: argparse.Namespace) -> int:
    model = _model_arg(args)  # a bad model is refused before torch is imported
    from pdserve.engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(**{**values_from_args(EngineConfig, args), "model": model})
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    started = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    elapsed = time.perf_counter() - started
    # Generated text may hold control characters that would drive a terminal; a pipe gets it raw.
    print(escape_controls(out.text) if sys.stdout.isatty() else out.text, flush=True)
    num = len(out.token_ids)
    print(
        f"pdserve: {num} tokens in {elapsed:.2f} s ({num / max(elapsed, 1e-9):.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _node(args: argparse.Namespace) -> int:
    from pdserve.cluster.keys import node_keys

    check_model(args.model)
    options, engine = from_args(NodeOptions, args), from_args(EngineConfig, args)
    node_keys(options.cluster_keys, options.insecure)  # missing keys: one line, before the model
    if args.command == "prefill":
        from pdserve.prefill_node.worker import serve

        serve(options, engine)
    else:
        from pdserve.decode_node.worker import serve

        serve(options, engine, colocated=args.colocated)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pdserve.coordinator.request_guard import api_keys_from
    from pdserve.serve import ServeOptions, run_serve

    start_nodes = args.command == "serve"
    given = getattr(args, "model_arg", None) or getattr(args, "model", None)
    for line in apply_vllm_flags(args, given):  # before anything starts: printed once
        print(line, file=sys.stderr)
    node = values_from_args(NodeOptions, args)
    return run_serve(
        ServeOptions(
            model=_model_arg(args),
            config_path=args.config,
            prefill_nodes=getattr(args, "prefill_nodes", 0),
            decode_nodes=getattr(args, "decode_nodes", 0),
            colocated=getattr(args, "colocated", False),
            host=args.host,
            port=args.port,
            node_port=args.node_port,
            client_port=args.client_port,
            engine={k: v for k, v in values_from_args(EngineConfig, args).items() if k != "model"},
            node={k: v for k, v in node.items() if k not in SECURITY + TRACING},
            roles=values_from_args(RoleTensorParallel, args),
            coordinator=values_from_args(CoordinatorConfig, args),
            cluster_keys=node.get("cluster_keys"),
            insecure=node.get("insecure", False),
            otlp_traces_endpoint=node.get("otlp_traces_endpoint"),
            api_keys=api_keys_from(args.api_key),
            served_model_names=tuple(args.served_model_name or ()),
            chat_template=args.chat_template,
            start_nodes=start_nodes,
            log_dir=getattr(args, "log_dir", None),
            drain_timeout_s=args.drain_timeout,
            http_log_level=getattr(args, "uvicorn_log_level", None),
        )
    )


def _keygen(args: argparse.Namespace) -> int:
    from pdserve.cluster.keys import ClusterKeys

    keys = ClusterKeys.generate().write(args.directory)
    print(
        f"pdserve: wrote the cluster key set {keys.fingerprint}... to {keys.directory}: copy "
        "that directory to every host of the cluster (its cluster.key_secret makes a member; "
        "keep it mode 0600)"
    )
    return 0


def _launch(args: argparse.Namespace) -> int:
    import socket

    from pdserve.cluster.keys import ClusterKeys
    from pdserve.cluster_file import key_dir, load_cluster_file, log_dir, plan
    from pdserve.supervisor import Supervisor

    spec = load_cluster_file(args.cluster_file)
    host = args.host
    if host is None:
        names = [h.name for h in spec.hosts]
        here = socket.gethostname()
        if here in names:
            host = here
        elif len(names) == 1:
            host = names[0]
        else:
            raise ValueError(
                f"this machine ({here}) is none of the hosts {names}: give --host NAME"
            )
    plans = plan(spec, host)
    logs = log_dir(spec)
    keys = "none (insecure)" if spec.insecure else key_dir(spec)
    if args.dry_run:
        print(
            f"# pdserve launch {args.cluster_file} --host {host}: {len(plans)} processes, "
            f"logs in {logs}, cluster keys in {keys}"
        )
        for p in plans:
            print(p.describe())
        return 0
    if spec.cluster_keys is not None:  # checked before anything starts: one line if unusable
        ClusterKeys.load(spec.cluster_keys)
    elif not spec.insecure:
        ClusterKeys.load_or_create(key_dir(spec))  # a cluster on loopback: this user's own
    url = f"http://{spec.coordinator_address}:{spec.http_port}"
    # Every host says the cluster serves once every node of the file, its own among them, has
    # registered.
    supervisor = Supervisor(
        plans,
        logs,
        drain_timeout_s=spec.drain_timeout_s,
        serving_url=url,
        serving_nodes=spec.node_counts,
    )
    return supervisor.run()


def _tune(args: argparse.Namespace) -> int:
    from pdserve.tune.command import run

    return run(args)


def _process_title(args: argparse.Namespace) -> str:
    if args.command in ("prefill", "decode"):
        return f"pdserve-{args.node_id}"
    return f"pdserve-{args.command}"


def _add_model_positional(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="checkpoint directory in Hugging Face format, as --model (default: pdserve-stories)",
    )


def _add_frontend_flags(p: argparse.ArgumentParser) -> None:
    """What the coordinator's HTTP frontend takes, in serve and coordinator alike."""
    add_flags(p, EngineConfig, only=("model",))
    p.add_argument(
        "--config",
        default=None,
        help="config file (TOML) of the coordinator and the "
        "nodes it starts, see docs/configuration.md; the flags given override its "
        "keys (unset: every setting at its default or flag)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--client-port",
        type=int,
        default=None,
        help="port of the Python client's socket (CoordinatorClient); unset: none",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=None,
        help="the model's names in the API: the first in responses and /v1/models, any in "
        "requests (unset: the embedded model's name or the model directory's name)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template file (unset: the model's own)",
    )
    add_flags(p, CoordinatorConfig, only=SERVE_COORDINATOR_FLAGS, suppress_defaults=True)
    add_flags(p, NodeOptions, only=SECURITY + TRACING, suppress_defaults=True)
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        default=None,
        help="the HTTP API takes only requests with `Authorization: Bearer KEY` (or "
        "`x-api-key: KEY`); "
        "repeat for several keys (unset: $PDSERVE_API_KEY, else open)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="log lines of this level and above",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=description, formatter_class=HelpFormatter
        )

    serve = command(
        "serve",
        "serve a model: the coordinator and its nodes on this machine",
        "Serve MODEL behind an OpenAI-compatible HTTP API: the coordinator, which takes the "
        "requests, and its prefill and decode nodes as child processes of this one. Engine "
        "flags apply to every node; they override the --config file's keys of the same name, "
        "which override the defaults. Ctrl-C stops everything; SIGTERM lets running requests "
        "finish first; SIGHUP re-reads --config.",
    )
    _add_model_positional(serve)
    _add_frontend_flags(serve)
    serve.add_argument("--prefill-nodes", type=int, default=1, help="prefill node processes")
    serve.add_argument(
        "--decode-nodes",
        type=int,
        default=1,
        help="decode node processes (colocated workers with --colocated)",
    )
    serve.add_argument(
        "--colocated",
        action="store_true",
        help="workers that prefill and decode alike: no disaggregation",
    )
    serve.add_argument("--node-port", type=int, default=0, help="port nodes connect to (0: any)")
    serve.add_argument(
        "--log-dir",
        default=None,
        help="one log file per node here (unset: the nodes log to this console)",
    )
    engine = serve.add_argument_group("engine settings (every node)")
    add_flags(engine, EngineConfig, exclude=("model",), suppress_defaults=True)
    add_flags(engine, RoleTensorParallel, suppress_defaults=True)
    add_flags(engine, NodeOptions, only=SERVE_NODE_FLAGS, suppress_defaults=True)
    add_vllm_flags(serve)
    serve.set_defaults(func=_serve)

    coordinator = command(
        "coordinator",
        "start the coordinator alone; nodes join it from any host",
        "Start the coordinator alone: the OpenAI-compatible HTTP API, routing and admission. "
        "It starts no node: nodes started with `pdserve prefill` and `pdserve decode` (or "
        "`pdserve launch`) on any host connect to --node-port and take their engine settings "
        "as their own flags. MODEL gives the tokenizer and the served name; it must be the "
        "nodes' checkpoint.",
    )
    _add_model_positional(coordinator)
    _add_frontend_flags(coordinator)
    coordinator.add_argument(
        "--node-port", type=int, default=0, help="port nodes connect to (0: any, printed at start)"
    )
    coordinator.set_defaults(func=_serve)

    gen = command(
        "generate",
        "generate a completion offline and print it",
        "Load MODEL in this process, generate one completion and print its text; the token "
        "count, time and tokens/s go to stderr.",
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="-1: no top-k")
    gen.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="sampling seed (unset: unseeded)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    # The engine's own seed would clash with the sampling seed's flag; it keeps its default.
    add_flags(gen.add_argument_group("engine settings"), EngineConfig, exclude=("seed",))
    gen.set_defaults(func=_generate)

    keygen = command(
        "keygen",
        "make a cluster key set",
        "Write a new cluster key set (a CurveZMQ key pair) into DIRECTORY: every process of a "
        "cluster holding it may join, and everything between them is encrypted. Copy DIRECTORY "
        "to every host and name it as cluster_keys in the cluster file, or as --cluster-keys. "
        "See docs/security.md.",
    )
    keygen.add_argument(
        "directory", metavar="DIRECTORY", help="made if missing; must hold no key set"
    )
    keygen.set_defaults(func=_keygen)

    launch = command(
        "launch",
        "start and supervise one host's part of a cluster file",
        "Start this host's processes of CLUSTER_FILE, restart one that dies (one that dies "
        "within seconds of starting, again and again, stops everything), and drain on SIGTERM. "
        "See docs/deployment.md.",
    )
    launch.add_argument("cluster_file", help="cluster file (TOML), see docs/deployment.md")
    launch.add_argument(
        "--host",
        default=None,
        help="which [[host]] of the file this machine is (unset: the one named "
        "like this machine, or the only one)",
    )
    launch.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    launch.set_defaults(func=_launch)

    tune = command(
        "tune", "search deployments for goodput under an SLO, in simulation", TUNE_DESCRIPTION
    )
    add_tune_arguments(tune)
    tune.set_defaults(func=_tune)

    for verb in ("prefill", "decode"):
        p = command(
            verb,
            f"start one {verb} node pointed at a coordinator",
            f"Start one {verb} node that joins the coordinator at --coordinator. Every engine "
            "setting is a flag named after its config key.",
        )
        add_flags(p.add_argument_group("node settings"), NodeOptions)
        if verb == "decode":
            p.add_argument("--colocated", action="store_true", help="prefill here too")
        add_flags(p.add_argument_group("engine settings"), EngineConfig)
        p.set_defaults(func=_node)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The command line as given (a results file names it): argv, or the process's own.
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from setproctitle import setproctitle

        setproctitle(_process_title(args))  # operators find each role with ps and top
    except ImportError:
        pass
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s {args.command} %(name)s: %(message)s",
    )
    # `kill -USR1 PID` writes every thread's stack to the process's log: what a stuck one is doing
    # (not where stderr is no file, as when main() is called inside a test runner).
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input: one line, no traceback.
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130  # Ctrl-C before the signal handlers were in place: no traceback either


if __name__ == "__main__":
    sys.exit(main())
