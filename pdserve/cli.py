"""The `pdserve` command: parses arguments and hands off to the parts; no logic of its own."""

from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: pdserve-tiny)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--scheduling-policy", default="continuous", choices=["continuous", "static"])
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--cuda-graph-max-batch-size", type=int, default=256)


def _engine_config(args: argparse.Namespace):  # noqa: ANN202
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        kernel_backend=args.kernel_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
    )


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    (out,) = llm.generate([prompt], params)
    print(out.text)
    return 0


def _node(args: argparse.Namespace) -> int:
    from cluster.node_options import NodeOptions

    options = NodeOptions(
        coordinator=args.coordinator,
        node_id=args.node_id,
        transport=args.transport,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        heartbeat_interval_s=args.heartbeat_interval,
        kv_handoff=getattr(args, "kv_handoff", "immediate"),
    )
    if args.command == "prefill":
        from prefill_node.worker import serve

        serve(options, _engine_config(args))
    else:
        from decode_node.worker import serve

        serve(options, _engine_config(args), colocated=args.colocated)
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
            transport=args.transport,
            host=args.host,
            port=args.port,
            node_port=args.node_port,
            client_port=args.client_port,
            dtype=args.dtype,
            device=args.device,
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


def _process_title(args: argparse.Namespace) -> str:
    if args.command in ("prefill", "decode"):
        return f"pdserve-{args.node_id}"
    return f"pdserve-{args.command}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline and print it")
    gen.add_argument("--model", default=None, help="checkpoint directory (default: pdserve-tiny)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.set_defaults(func=_generate)

    for verb, text in (
        ("serve", "start the coordinator and its nodes on this machine"),
        ("coordinator", "start the coordinator alone; nodes join it from any host"),
    ):
        p = sub.add_parser(verb, help=text)
        p.add_argument("--model", default=None, help="checkpoint directory (default: pdserve-tiny)")
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
        p.add_argument("--transport", default="tcp", choices=["tcp", "shm", "cuda_ipc", "nccl"])
        p.add_argument("--dtype", default="auto")
        p.add_argument("--device", default="auto")
        p.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds running requests get to finish")  # fmt: skip
        p.set_defaults(func=_serve)

    launch = sub.add_parser("launch", help="start and supervise one host's part of a cluster file")
    launch.add_argument("cluster_file", help="cluster file (TOML), see docs/deployment.md")
    launch.add_argument("--host", default=None, help="which host of the file this is")
    launch.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    launch.set_defaults(func=_launch)

    for verb in ("prefill", "decode"):
        p = sub.add_parser(verb, help=f"start one {verb} node pointed at a coordinator")
        p.add_argument("--coordinator", required=True, help="tcp://HOST:NODE_PORT")
        p.add_argument("--node-id", required=True)
        p.add_argument("--transport", default="tcp", choices=["tcp", "shm", "cuda_ipc", "nccl"])
        p.add_argument("--kv-host", default="127.0.0.1", help="address the KV receiver binds")
        p.add_argument("--kv-port", type=int, default=0, help="port of the KV receiver (0: any)")
        p.add_argument("--heartbeat-interval", type=float, default=0.5)
        if verb == "decode":
            p.add_argument("--colocated", action="store_true", help="prefill here too")
        else:
            p.add_argument(
                "--kv-handoff",
                default="immediate",
                choices=["immediate", "between-steps"],
                help="start a KV send as soon as it is asked for (a thread), or between steps",
            )
        _add_engine_args(p)
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
