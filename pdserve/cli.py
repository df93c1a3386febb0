"""The `pdserve` command: parses arguments and hands off to the parts; no logic of its own."""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.node_options import NodeOptions
from cluster.schema import add_flags, from_args, values_from_args
from engine.config import EngineConfig
from tune.command import add_arguments as add_tune_arguments

# The engine settings serve and coordinator take as flags; the others come from --config.
SERVE_ENGINE_FLAGS = ("dtype", "device")


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(**values_from_args(EngineConfig, args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    (out,) = llm.generate([prompt], params)
    print(out.text)
    return 0


def _node(args: argparse.Namespace) -> int:
    options, engine = from_args(NodeOptions, args), from_args(EngineConfig, args)
    if args.command == "prefill":
        from prefill_node.worker import serve

        serve(options, engine)
    else:
        from decode_node.worker import serve

        serve(options, engine, colocated=args.colocated)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pdserve.serve import ServeOptions, run_serve

    return run_serve(
        ServeOptions(
            model=args.model,
            config_path=args.config,
            prefill_nodes=args.prefill_nodes,
            decode_nodes=args.decode_nodes,
            colocated=args.colocated,
            host=args.host,
            port=args.port,
            node_port=args.node_port,
            client_port=args.client_port,
            engine=values_from_args(EngineConfig, args),
            node=values_from_args(NodeOptions, args),
            start_nodes=args.command == "serve",
            log_dir=args.log_dir,
            drain_timeout_s=args.drain_timeout,
        )
    )


def _launch(args: argparse.Namespace) -> int:
    import socket

    from pdserve.cluster_file import load_cluster_file, plan
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
    if args.dry_run:
        print(f"# pdserve launch {args.cluster_file} --host {host}: {len(plans)} processes")
        for p in plans:
            print(p.describe())
        return 0
    log_dir = spec.log_dir or (spec.path.parent / "logs")
    supervisor = Supervisor(plans, log_dir, drain_timeout_s=spec.drain_timeout_s)
    return supervisor.run()


def _tune(args: argparse.Namespace) -> int:
    from tune.command import run

    return run(args)


def _process_title(args: argparse.Namespace) -> str:
    if args.command in ("prefill", "decode"):
        return f"pdserve-{args.node_id}"
    return f"pdserve-{args.command}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline and print it")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    # The engine's own seed would clash with the sampling seed's flag; it keeps its default.
    add_flags(gen.add_argument_group("engine settings"), EngineConfig, exclude=("seed",))
    gen.set_defaults(func=_generate)

    for verb, text in (
        ("serve", "start the coordinator and its nodes on this machine"),
        ("coordinator", "start the coordinator alone; nodes join it from any host"),
    ):
        p = sub.add_parser(verb, help=text)
        add_flags(p, EngineConfig, only=("model",))
        p.add_argument("--config", default=None, help="coordinator config (TOML)")
        p.add_argument("--host", default="127.0.0.1", help="HTTP host")
        p.add_argument("--port", type=int, default=8000, help="HTTP port")
        p.add_argument("--node-port", type=int, default=0, help="port nodes connect to (0: any)")
        p.add_argument(
            "--client-port", type=int, default=None, help="port of the Python client socket"
        )
        p.add_argument("--log-dir", default=None, help="one log file per node here")
        p.add_argument("--prefill-nodes", type=int, default=1)
        p.add_argument("--decode-nodes", type=int, default=1)
        p.add_argument(
            "--colocated", action="store_true", help="colocated workers, no disaggregation"
        )
        # Given flags only, so that they override the config file's node settings.
        add_flags(p, NodeOptions, only=("transport",), suppress_defaults=True)
        add_flags(p, EngineConfig, only=SERVE_ENGINE_FLAGS, suppress_defaults=True)
        p.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds running requests get to finish")  # fmt: skip
        p.set_defaults(func=_serve)

    launch = sub.add_parser("launch", help="start and supervise one host's part of a cluster file")
    launch.add_argument("cluster_file", help="cluster file (TOML), see docs/deployment.md")
    launch.add_argument("--host", default=None, help="which host of the file this is")
    launch.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    launch.set_defaults(func=_launch)

    tune = sub.add_parser("tune", help="search deployments for goodput under an SLO, in simulation")
    add_tune_arguments(tune)
    tune.set_defaults(func=_tune)

    for verb in ("prefill", "decode"):
        p = sub.add_parser(verb, help=f"start one {verb} node pointed at a coordinator")
        add_flags(p.add_argument_group("node settings"), NodeOptions)
        if verb == "decode":
            p.add_argument("--colocated", action="store_true", help="prefill here too")
        add_flags(p.add_argument_group("engine settings"), EngineConfig)
        p.set_defaults(func=_node)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from setproctitle import setproctitle

        setproctitle(_process_title(args))  # operators find each role with ps and top
    except ImportError:
        pass
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {args.command} %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input: one line, no traceback.
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
