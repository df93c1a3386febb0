"""What tensor parallelism adds to a step, side by side in one run at TP=2 (two processes, gloo
on CPU, NCCL on GPU), the model's own compute left out:

- the plan handoff: rank 0 hands a step's plan to rank 1 through the shared-memory channel the
  engine uses (`engine/plan_channel.py`), or as torch.distributed's broadcast_object_list does it
  (pickle, broadcast the length, broadcast the bytes), for decode steps of 1 to 256 sequences and
  a 2048-token prefill; each is timed with a 1-element all-reduce that ends the step, whose own
  time (the `barrier` row) is subtracted;
- the collectives of one forward: an all-reduce of [tokens, hidden] after the embedding and after
  each layer's attention and MLP, and the gather of the logits onto rank 0, for a model's shape.

    python -m pdserve.bench.tp_overhead                       # tiny and Llama-3-8B shapes, plans
    python -m pdserve.bench.tp_overhead --json out.json --repeats 200
    python -m pdserve.bench.tp_overhead --quick --repeats 5   # checks the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve import SOURCE_ROOT
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.plan_channel import PlanChannel, plan_capacity
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.tp_group import TPGroup, host_store
from pdserve.engine.tp_shard import TPShard

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
# (name, decode sequences or prefill tokens, context of each sequence)
PLANS = [
    ("decode-1", 1, 512),
    ("decode-64", 64, 512),
    ("decode-256", 256, 4096),
    ("prefill-2048", 2048, 2048),
]
# (name, hidden, layers, vocab): the tiny test model's and Llama-3-8B's shapes.
SHAPES = [("tiny", 128, 2, 512), ("llama3-8b", 4096, 32, 128256)]
BATCHES = [1, 64]


def make_plan(kind: str, n: int, context: int) -> StepPlan:
    params = SamplingParams()
    blocks = -(-context // BLOCK_SIZE)
    if kind.startswith("prefill"):
        seq = Sequence("p", [7] * n, params, (1,))
        seq.block_table = list(range(blocks))
        return StepPlan.from_scheduled(SchedulerOutput([ScheduledSeq(seq, n)]), BLOCK_SIZE)
    scheduled = []
    for i in range(n):
        seq = Sequence(str(i), [7] * context, params, (1,))
        seq.block_table = list(range(i * blocks, (i + 1) * blocks))
        seq.num_computed_tokens = context - 1
        scheduled.append(ScheduledSeq(seq, 1))
    return StepPlan.from_scheduled(SchedulerOutput(scheduled), BLOCK_SIZE)


@dataclass(slots=True)
class Trials:
    repeats: int
    device: str
    plans: list[tuple[str, int, int]]
    shapes: list[tuple[str, int, int, int]]
    batches: list[int]


def broadcast_object(group: TPGroup, obj: object | None) -> object:
    """broadcast_object_list's way, on our group: pickle, the length, then the bytes."""
    if group.rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    group.pg.broadcast([size]).wait()
    if group.rank != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.pg.broadcast([data]).wait()
    return obj if group.rank == 0 else pickle.loads(data.numpy().tobytes())


def forward_collectives(group: TPGroup, hidden: torch.Tensor, logits: torch.Tensor, layers: int):
    group.all_reduce(hidden)  # the embedding
    for _ in range(layers):
        group.all_reduce(hidden)  # attention's o_proj
        group.all_reduce(hidden)  # the MLP's down_proj
    group.gather_to_first(logits)


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    """Median of 5 runs of `repeats` calls, in microseconds per call (both ranks run alike)."""
    runs = []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        runs.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(runs[1:])  # the first warms up


def run_trials(group: TPGroup, trials: Trials, channel, reader) -> dict:  # noqa: ANN001
    """Both ranks call this; rank 0's figures are returned."""
    first = group.rank == 0
    out: dict = {"plans": [], "collectives": []}
    barrier_us = timed(group.barrier, trials.repeats)
    out["barrier_us"] = barrier_us
    for name, n, context in trials.plans:
        plan = make_plan(name, n, context) if first else None
        size = len(pickle.dumps(plan)) if first else 0

        def shm(plan: StepPlan | None = plan) -> None:
            if first:
                channel.publish(plan)
            else:
                reader.receive()
            group.barrier()

        def gloo(plan: StepPlan | None = plan) -> None:
            broadcast_object(group, plan)
            group.barrier()

        shm_us = timed(shm, trials.repeats) - barrier_us
        gloo_us = timed(gloo, trials.repeats) - barrier_us
        out["plans"].append({"plan": name, "bytes": size, "shm_us": shm_us, "gloo_us": gloo_us})
    for name, hidden_size, layers, vocab in trials.shapes:
        for batch in trials.batches:
            hidden = torch.zeros(batch, hidden_size, device=group.device)
            logits = torch.zeros(batch, -(-vocab // group.size), device=group.device)

            def step(hidden=hidden, logits=logits, layers=layers) -> None:  # noqa: ANN001
                forward_collectives(group, hidden, logits, layers)

            us = timed(step, max(1, trials.repeats // 10))
            out["collectives"].append(
                {
                    "shape": name,
                    "batch": batch,
                    "all_reduces": 2 * layers + 1,
                    "bytes_per_all_reduce": hidden.numel() * hidden.element_size(),
                    "step_us": us,
                }
            )
    return out


def worker() -> None:
    """Rank 1 (`python -c "from pdserve.bench.tp_overhead import worker; worker()"`)."""
    port, inbox, fields = pickle.load(sys.stdin.buffer)
    trials = Trials(**fields)
    torch.set_num_threads(1)
    reader = inbox.open()
    device = "cuda:1" if trials.device.startswith("cuda") else "cpu"
    group = TPGroup.join(TPShard(1, 2), device, port=port)
    run_trials(group, trials, None, reader)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.device_count() > 1 else "cpu")
    parser.add_argument("--repeats", type=int, default=100, help="steps per timed run")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one decode plan, the tiny shape at batch 1 (checks the script)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.quick:
        trials = Trials(args.repeats, args.device, PLANS[:1], SHAPES[:1], BATCHES[:1])
    else:
        trials = Trials(args.repeats, args.device, PLANS, SHAPES, BATCHES)
    store = host_store(2)
    max_blocks = max(-(-c // BLOCK_SIZE) for _, _, c in trials.plans)
    channel = PlanChannel(1, plan_capacity(2048, max_blocks))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    inbox = channel.inbox(0)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from pdserve.bench.tp_overhead import worker; worker()"],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(inbox.fd,),
        )
        channel.handed_over(0)
        proc.stdin.write(pickle.dumps((store.port, inbox, asdict(trials))))
        proc.stdin.close()
        device = "cuda:0" if args.device.startswith("cuda") else "cpu"

        def check() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"rank 1 exited ({proc.returncode}) before the group formed")

        group = TPGroup.join(TPShard(0, 2), device, store=store, check_ranks=check)
        channel.unlink()
        results = run_trials(group, trials, channel, None)
        proc.wait(60)
    finally:
        channel.close()  # its file too, however this ends
    results["machine"] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "device": args.device,
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
    }
    results["repeats"] = args.repeats
    print(f"TP=2 on {args.device}; barrier (1-element all-reduce): {results['barrier_us']:.0f} us")
    print(f"{'plan':>14} {'bytes':>9} {'shm us':>8} {'gloo us':>8}")
    for p in results["plans"]:
        print(f"{p['plan']:>14} {p['bytes']:>9} {p['shm_us']:>8.0f} {p['gloo_us']:>8.0f}")
    print(f"{'shape':>10} {'batch':>5} {'all-reduces':>11} {'bytes each':>10} {'step ms':>8}")
    for c in results["collectives"]:
        print(
            f"{c['shape']:>10} {c['batch']:>5} {c['all_reduces']:>11} "
            f"{c['bytes_per_all_reduce']:>10} {c['step_us'] / 1000:>8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
