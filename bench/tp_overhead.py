"""What tensor parallelism adds to a step, side by side in one run at TP=2 (two processes, gloo
on CPU, NCCL on GPU), the model's own compute left out:

- the plan handoff: rank 0 hands a step's plan to rank 1 through the shared-memory channel the
  engine uses (`engine/tp/plan_channel.py`), or as torch.distributed's broadcast_object_list does it
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
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve import SOURCE_ROOT
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.tp.group import TPGroup, host_store
from pdserve.engine.tp.plan_channel import PlanChannel, plan_capacity
from pdserve.engine.tp.shard import TPShard
from pdserve.tune import provenance

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


def timed(fn, repeats: int) -> list[float]:  # noqa: ANN001
    """5 runs of `repeats` calls after one that warms up, in microseconds per call (both ranks
    run alike); the figures are their median."""
    runs = []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        runs.append((time.perf_counter() - t0) / repeats * 1e6)
    return runs[1:]


def run_trials(group: TPGroup, trials: Trials, channel, reader) -> dict:  # noqa: ANN001
    """Both ranks call this; rank 0's figures are returned."""
    first = group.rank == 0
    out: dict = {"plans": [], "collectives": []}
    barrier_runs = timed(group.barrier, trials.repeats)
    barrier_us = statistics.median(barrier_runs)
    out["barrier_us"], out["barrier_runs_us"] = barrier_us, barrier_runs
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

        shm_runs = timed(shm, trials.repeats)
        gloo_runs = timed(gloo, trials.repeats)
        out["plans"].append(
            {
                "plan": name,
                "sequences_or_tokens": n,
                "context": context,
                "bytes": size,
                "shm_us": statistics.median(shm_runs) - barrier_us,
                "gloo_us": statistics.median(gloo_runs) - barrier_us,
                "shm_runs_us": shm_runs,  # each with the barrier in it
                "gloo_runs_us": gloo_runs,
            }
        )
    for name, hidden_size, layers, vocab in trials.shapes:
        for batch in trials.batches:
            hidden = torch.zeros(batch, hidden_size, device=group.device)
            logits = torch.zeros(batch, -(-vocab // group.size), device=group.device)

            def step(hidden=hidden, logits=logits, layers=layers) -> None:  # noqa: ANN001
                forward_collectives(group, hidden, logits, layers)

            runs = timed(step, max(1, trials.repeats // 10))
            out["collectives"].append(
                {
                    "shape": name,
                    "hidden": hidden_size,
                    "layers": layers,
                    "vocabulary": vocab,
                    "batch": batch,
                    "all_reduces": 2 * layers + 1,
                    "bytes_per_all_reduce": hidden.numel() * hidden.element_size(),
                    "step_us": statistics.median(runs),
                    "runs_us": runs,
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
    record = provenance.start([__file__, *(sys.argv[1:] if argv is None else argv)])
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
    results = provenance.finish(record) | {"device": args.device, "repeats": args.repeats} | results
    print(f"TP=2 on {args.device}; barrier (1-element all-reduce): {results['barrier_us']:.0f} us")
    print(plans_table(results))
    print()
    print(collectives_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


# --- the docs' tables (`python -m pdserve.bench.docs` renders them) ------------------------------


def _spaced(n: float) -> str:
    """A whole number with a thin space between thousands, as the docs write them."""
    return f"{n:,.0f}".replace(",", " ")


def _plan_label(row: dict) -> str:
    name = row["plan"]
    known = {p[0]: p for p in PLANS}
    n = row.get("sequences_or_tokens", known.get(name, (name, 0, 0))[1])
    context = row.get("context", known.get(name, (name, 0, 0))[2])
    if name.startswith("prefill"):
        return f"prefill, {n} tokens"
    return f"decode, {n} sequence{'s' if n != 1 else ''} of {context} tokens"


def plans_table(results: dict) -> str:
    """The plan handoff: pickled bytes, shared-memory channel and gloo broadcast, barrier off."""
    out = [
        "| plan | pickled bytes | shared memory µs | gloo broadcast µs |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in results["plans"]:
        out.append(
            f"| {_plan_label(row)} | {_spaced(row['bytes'])} | {_spaced(row['shm_us'])} | "
            f"{_spaced(row['gloo_us'])} |"
        )
    return "\n".join(out)


def collectives_table(results: dict) -> str:
    """A forward's all-reduces and logits gather at each shape and batch, ms per step."""
    shapes = {name: (hidden, layers, vocab) for name, hidden, layers, vocab in SHAPES}
    labels = {"tiny": "tiny", "llama3-8b": "Llama-3-8B"}
    out = [
        "| collectives of one forward | batch | all-reduces | bytes each | ms per step |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    seen = set()
    for row in results["collectives"]:
        name = row["shape"]
        label = labels.get(name, name)
        if name not in seen:
            hidden, layers, vocab = (
                (row["hidden"], row["layers"], row["vocabulary"])
                if "hidden" in row
                else shapes[name]
            )
            label += f" (hidden {hidden}, {layers} layers, vocabulary {vocab})"
            seen.add(name)
        out.append(
            f"| {label} | {row['batch']} | {row['all_reduces']} | "
            f"{_spaced(row['bytes_per_all_reduce'])} | {row['step_us'] / 1e3:.3g} |"
        )
    return "\n".join(out)


def barrier_sentence(results: dict) -> str:
    """The 1-element all-reduce's own time, subtracted from every plan handoff above."""
    return f"The 1-element all-reduce itself took {results['barrier_us']:.0f} µs."


def steps_table(tp1: dict, tp2: dict) -> str:
    """Whole steps of one model at TP=1 and TP=2 (two `bench.model_step` results files)."""
    out = ["| step | TP=1 ms | TP=2 ms |", "| --- | ---: | ---: |"]
    for one, two in zip(tp1["decode"], tp2["decode"]):
        ms = [r["eager_ms"] if r.get("graph_ms") is None else r["graph_ms"] for r in (one, two)]
        out.append(
            f"| decode, batch {one['batch']}, context {one['context']} | {ms[0]:.2f} | "
            f"{ms[1]:.2f} |"
        )
    for one, two in zip(tp1["prefill"], tp2["prefill"]):
        n, length = one["prompts"], one["prompt_len"]
        what = f"one {length}-token prompt" if n == 1 else f"{n} prompts of {length} tokens"
        out.append(f"| prefill, {what} | {one['ms']:.2f} | {two['ms']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
