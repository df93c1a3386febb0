"""What handing a step's plan to the other tensor-parallel ranks costs in encoding: the pickle the
engine uses (`pdserve.engine.tp.plan_channel`) against msgspec's msgpack of the same arrays, the
round trip (encode, decode back into a `StepPlan`) timed side by side in one process.

    python -m pdserve.bench.plan_codec
    python -m pdserve.bench.plan_codec --json-out plan_codec.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from array import array
from pathlib import Path

import msgspec

from pdserve.engine.step_plan import StepPlan
from pdserve.tune import provenance


class WirePlan(msgspec.Struct, array_like=True):
    """A StepPlan's fields as msgpack carries them: each array as its bytes."""

    input_ids: bytes
    positions: bytes
    slots: bytes
    seq_lens: bytes
    query_start: bytes
    block_tables: bytes
    width: int
    sample_rows: list[int]
    max_query_len: int


ARRAYS = {
    "input_ids": "q",
    "positions": "q",
    "slots": "q",
    "seq_lens": "q",
    "query_start": "q",
    "block_tables": "i",
}
ENCODER, DECODER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(WirePlan)


def msgspec_round_trip(plan: StepPlan) -> StepPlan:
    fields = {name: getattr(plan, name).tobytes() for name in ARRAYS}
    wire = WirePlan(
        **fields, width=plan.width, sample_rows=plan.sample_rows, max_query_len=plan.max_query_len
    )
    back = DECODER.decode(ENCODER.encode(wire))
    arrays = {}
    for name, code in ARRAYS.items():
        arrays[name] = array(code)
        arrays[name].frombytes(getattr(back, name))
    return StepPlan(
        **arrays, width=back.width, sample_rows=back.sample_rows, max_query_len=back.max_query_len
    )


def pickle_round_trip(plan: StepPlan) -> StepPlan:
    return pickle.loads(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))


def plan(seqs: int, tokens_each: int, context: int, block_size: int = 16) -> StepPlan:
    n = seqs * tokens_each
    width = -(-context // block_size)
    return StepPlan(
        array("q", range(n)),
        array("q", range(n)),
        array("q", range(n)),
        array("q", [context] * seqs),
        array("q", range(0, n + 1, tokens_each)),
        array("i", range(seqs * width)),
        width,
        list(range(seqs)),
        tokens_each,
    )


PLANS = {
    "decode, 64 sequences of 4,096 tokens": (64, 1, 4096),
    "decode, 256 sequences of 4,096 tokens": (256, 1, 4096),
    "prefill, one prompt of 2,048 tokens": (1, 2048, 2048),
    "prefill, 8 prompts of 256 tokens": (8, 256, 256),
}


def best_us(fn, arg, calls: int, repeats: int = 5) -> float:  # noqa: ANN001
    """The fastest of `repeats` runs of `calls` calls, per call, in microseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(arg)
        times.append((time.perf_counter() - start) / calls)
    return round(min(times) * 1e6, 1)


def docs_table(results: dict) -> str:
    """The docs' table of a results file (`python -m pdserve.bench.docs` renders it)."""
    rows = ["| plan | bytes | pickle µs | msgspec µs |", "| --- | ---: | ---: | ---: |"]
    for name, row in results["plans"].items():
        rows.append(f"| {name} | {row['bytes']:,} | {row['pickle_us']} | {row['msgspec_us']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.plan_codec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    record = provenance.start(sys.argv)
    plans = {}
    for name, shape in PLANS.items():
        step = plan(*shape)
        assert msgspec_round_trip(step) == pickle_round_trip(step) == step
        row = {
            "bytes": len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)),
            "pickle_us": best_us(pickle_round_trip, step, args.calls),
            "msgspec_us": best_us(msgspec_round_trip, step, args.calls),
        }
        plans[name] = row
    results = provenance.finish(record) | {"plans": plans}
    print(docs_table(results))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
