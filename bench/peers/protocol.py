"""What passes between the peer benchmark and the process that runs one engine for one round: the
requests go in as a JSON file, the runner's arguments as a command line, the result comes back as
one JSON line on stdout after a fixed prefix (whatever else the engine prints is skipped).

Standard library only: the vLLM runner imports this file inside vLLM's own virtualenv."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

RESULT_PREFIX = "PEER-RESULT "


@dataclass(frozen=True, slots=True)
class RoundRequest:
    prompt: list[int]  # token ids
    output_len: int  # tokens to generate: greedy, ignore_eos, max_tokens = output_len


@dataclass(frozen=True, slots=True)
class RoundResult:
    engine: str
    elapsed_s: float  # generation only: model loading, compilation and warm-up are outside
    output_tokens: int
    cpu_s: float  # the runner's CPU time over the timed part (all its threads)
    version: str  # the engine's version
    threads: int  # torch's intra-op threads in the process that ran the model
    # CPU time the whole machine spent over the timed part (all processes, /proc/stat), so that
    # what other work took is machine_cpu_s - cpu_s.
    machine_cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def machine_cpu_seconds(stat: str | None = None) -> float:
    """Busy CPU time of the whole machine since boot, summed over cores: /proc/stat's first line
    (user, nice, system, irq, softirq, steal; not idle or iowait), in seconds."""
    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.readline()
        except OSError:
            return 0.0
    fields = [int(x) for x in stat.split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def write_requests(path: Path, requests: list[RoundRequest]) -> None:
    data = [{"prompt": r.prompt, "output_len": r.output_len} for r in requests]
    path.write_text(json.dumps({"requests": data}))


def read_requests(path: Path) -> list[RoundRequest]:
    data = json.loads(Path(path).read_text())["requests"]
    return [RoundRequest([int(t) for t in r["prompt"]], int(r["output_len"])) for r in data]


def runner_argv(model_dir: Path, requests_path: Path, max_num_seqs: int, block_size: int) -> list:
    """The arguments every runner takes (after its interpreter and script)."""
    return [
        "--model",
        str(model_dir),
        "--requests",
        str(requests_path),
        "--max-num-seqs",
        str(max_num_seqs),
        "--block-size",
        str(block_size),
    ]


def runner_parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--requests", type=Path, required=True, help="JSON file of token-id requests")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    return p


def parse_runner_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    return runner_parser(description).parse_args(argv)


def result_line(result: RoundResult) -> str:
    fields = {k: getattr(result, k) for k in RoundResult.__slots__}
    return RESULT_PREFIX + json.dumps(fields)


def parse_result(stdout: str) -> RoundResult:
    """The last result line of a runner's stdout."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        raise ValueError("the runner printed no result line")
    fields = json.loads(lines[-1][len(RESULT_PREFIX) :])
    return RoundResult(**{k: fields[k] for k in RoundResult.__slots__ if k in fields})
