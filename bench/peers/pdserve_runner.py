"""One round of pdserve's continuous engine on a request file, in a process of its own: the same
run as `pdserve.bench.offline_throughput`'s `continuous` system (model loading and a two-request warm-up
outside the timing) with the engine's defaults or the engine flags given (a variant's, see
bench.peers.variants), printed as one result line (protocol.RESULT_PREFIX + JSON) under its label.

    python -m pdserve.bench.peers.pdserve_runner --model DIR --requests FILE [--label L] [ENGINE FLAGS]"""

from __future__ import annotations

from pdserve.bench.peers.protocol import RoundResult, read_requests, result_line, runner_parser
from pdserve.bench.peers.variants import DEFAULT_LABEL, add_engine_flags, engine_options


def parse_args(argv: list[str] | None = None):
    p = runner_parser(description=__doc__)
    p.add_argument("--label", default=DEFAULT_LABEL, help="the engine name in the result line")
    add_engine_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    requests = read_requests(args.requests)

    import torch

    import pdserve
    from pdserve.bench.offline_throughput import run_pdserve

    # Threads as pdserve's engine sets them by default (torch's own default where it does not),
    # unless the variant's flags say otherwise.
    res = run_pdserve(
        args.model,
        requests,
        "continuous",
        args.max_num_seqs,
        args.block_size,
        progress=False,
        engine_options=engine_options(args),
    )
    version = getattr(pdserve, "__version__", "")
    result = RoundResult(
        args.label,
        res.elapsed_s,
        res.output_tokens,
        res.cpu_s,
        version,
        torch.get_num_threads(),
        res.machine_cpu_s,
    )
    print(result_line(result), flush=True)


if __name__ == "__main__":
    main()
