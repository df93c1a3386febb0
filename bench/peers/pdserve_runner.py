"""One round of pdserve's continuous engine on a request file, in a process of its own: the same
run as `bench.offline_throughput`'s `continuous` system (model loading and a two-request warm-up
outside the timing) with the engine's default threads, printed as one result line
(protocol.RESULT_PREFIX + JSON).

    python -m bench.peers.pdserve_runner --model DIR --requests FILE"""

from __future__ import annotations

from bench.peers.protocol import RoundResult, parse_runner_args, read_requests, result_line


def main(argv: list[str] | None = None) -> None:
    args = parse_runner_args(argv, description=__doc__)
    requests = read_requests(args.requests)

    import torch

    import pdserve
    from bench.offline_throughput import run_pdserve

    # Threads as pdserve's engine sets them by default (torch's own default where it does not).
    res = run_pdserve(
        args.model, requests, "continuous", args.max_num_seqs, args.block_size, progress=False
    )
    version = getattr(pdserve, "__version__", "")
    result = RoundResult(
        "pdserve", res.elapsed_s, res.output_tokens, res.cpu_s, version, torch.get_num_threads(),
        res.machine_cpu_s,
    )  # fmt: skip
    print(result_line(result), flush=True)


if __name__ == "__main__":
    main()
