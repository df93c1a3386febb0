"""Prefix reuse on a multi-turn chat workload: the same sessions against `pdserve serve`
(1 prefill + 1 decode node) in several modes, one server after the other in one run, each
started fresh (cold caches): `decode_prefix_reuse` on and off, on with host-memory KV tiers
under both nodes' pools (`--kv-host-bytes`), and that with placement by uncached tokens
(`local_prefill_max_uncached_tokens`, `--local-prefill-max-uncached`: a turn whose prompt the
decode node mostly holds is prefilled there), and for a linear-attention hybrid (Qwen3.5) with
its layers' state snapshots in the prefix cache at every block boundary and with none
(`--linear-snapshot-interval` 1 and 1000000: a later turn then finds no prefix at all). Reports
the prompt tokens the nodes computed (their `pdserve_prefill_tokens_computed_total`), the KV
bytes the decode node received (its `pdserve_kv_transfer_blocks_total`, times the bytes of a
block), the blocks it found cached or loaded back from a tier, TTFT (later turns' apart), the gap
from the first token to the second (the KV handoff's share of a request's latency), and the
blocks the nodes' prefix caches hold at the end.

    python -m pdserve.bench.multiturn --sessions 8 --concurrency 4 --json /tmp/multiturn.json
    python -m pdserve.bench.multiturn --model qwen3.5-37m --modes snapshots,no-snapshots \
        --first-len 1536:2048 --json /tmp/snapshots.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from pdserve.bench.peers import models as bench_models
from pdserve.bench.serve_load import HelpFormatter, length_range
from pdserve.bench.serving.multiturn import MultiTurnWorkload, TurnResult, run_sessions
from pdserve.engine.embedded.catalog import TINY, resolve_model_dir
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.state_pages import fitted_block_size
from pdserve.engine.models.config import ModelConfig
from pdserve.tune import provenance
from pdserve.tune.local_server import PdserveServer, PdserveSystem, free_port
from pdserve.tune.serving_metrics import percentile


@dataclass(frozen=True, slots=True)
class Mode:
    """What one server of the run is set to."""

    decode_prefix_reuse: bool = True
    tiers: bool = False  # host-memory KV tiers under both nodes' pools
    placement: bool = False  # local prefill by uncached tokens
    snapshot_interval: int | None = None  # linear_snapshot_interval; None: the engine's default


# An interval no prompt reaches: a linear layer's state never enters the prefix cache.
NO_SNAPSHOTS = 1_000_000
MODES = {
    "reuse-on": Mode(),
    "reuse-off": Mode(decode_prefix_reuse=False),
    "tiers": Mode(tiers=True),
    "tiers+placement": Mode(tiers=True, placement=True),
    "snapshots": Mode(snapshot_interval=1),
    "no-snapshots": Mode(snapshot_interval=NO_SNAPSHOTS),
}
# /metrics counters summed over the nodes, by what the results call them.
COUNTERS = {
    "prompt_tokens_computed": "pdserve_prefill_tokens_computed_total",
    "blocks_received": "pdserve_kv_transfer_blocks_total",
    "blocks_reused": "pdserve_kv_transfer_blocks_reused_total",
    "tier_blocks_loaded": "pdserve_kv_tier_hit_blocks_total",
}
# The gauge of blocks the nodes' prefix caches hold in their pools (every KV group's: a hybrid's
# linear groups' state snapshots among them), by the coordinator's prefix index.
CACHED_BLOCKS = ("pdserve_prefix_index_blocks", 'tier="device"')


def counters(base_url: str) -> dict[str, int]:
    """The nodes' COUNTERS from /metrics, each summed over nodes (and tiers), and the blocks
    their prefix caches hold (`cached_blocks`)."""
    text = httpx.get(base_url + "/metrics", timeout=30).text

    def total(name: str, label: str = "") -> int:
        found = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
        return int(sum(float(v) for labels, v in found if label in labels))

    return {key: total(name) for key, name in COUNTERS.items()} | {
        "cached_blocks": total(*CACHED_BLOCKS)
    }


def settle(base_url: str, quiet_s: float = 2.0, timeout_s: float = 60.0) -> dict[str, int]:
    """Counters once the nodes' load reports (every 0.5 s) have stopped changing them for
    quiet_s: on a loaded machine a node's report can lag the work it counts by more than a
    fixed wait (a run once read half its prompt tokens after a 1.5 s sleep)."""
    deadline = time.monotonic() + timeout_s
    last, since = counters(base_url), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.25)
        now = counters(base_url)
        if now != last:
            last, since = now, time.monotonic()
    return last


def served_model(model: str) -> str:
    """The checkpoint the nodes load: a bench model's directory (built on first use), else
    `model` as given (an embedded model's name or a directory)."""
    return str(bench_models.resolve(model)) if model in bench_models.MODELS else model


def run_mode(
    name: str, args: argparse.Namespace, workload: MultiTurnWorkload, work: Path, model: str
) -> dict:
    mode = MODES[name]
    client_port = free_port()
    config: dict = {"decode_prefix_reuse": mode.decode_prefix_reuse}
    if mode.placement:
        config["local_prefill_max_uncached_tokens"] = args.local_prefill_max_uncached
    system = PdserveSystem(
        name,
        config=config,
        flags=("--transport", args.transport, "--client-port", str(client_port)),
    )
    engine_flags = ("--block-size", str(args.block_size), "--num-kv-blocks", str(args.kv_blocks))
    engine_flags += ("--kv-host-bytes", str(args.kv_host_bytes if mode.tiers else 0))
    if mode.snapshot_interval is not None:
        engine_flags += ("--linear-snapshot-interval", str(mode.snapshot_interval))
    system.flags += engine_flags
    with PdserveServer(system, work, model=model) as server:
        address = f"tcp://127.0.0.1:{client_port}"
        warm = MultiTurnWorkload(num_sessions=1, turns=(2, 2), token_id_range=(500, 511))
        asyncio.run(run_sessions(address, warm.sample(args.seed + 1), 1))
        before = settle(server.base_url)
        results = asyncio.run(run_sessions(address, workload.sample(args.seed), args.concurrency))
        after = settle(server.base_url)
    counted = {key: after[key] - before[key] for key in COUNTERS}
    # Held at the end: the warm-up's few blocks among them, the evicted ones not.
    counted["cached_blocks"] = after["cached_blocks"]
    return summarize(name, results, counted, args, model)


def summarize(
    name: str,
    results: list[TurnResult],
    counted: dict[str, int],
    args: argparse.Namespace,
    model: str,
) -> dict:
    mode = MODES[name]
    block_size = served_block_size(model, args.block_size)
    block_bytes = kv_block_bytes(model, args.block_size)
    n = len(results)
    first = [r for r in results if r.turn == 0]
    later = [r for r in results if r.turn > 0]

    def ms(values: list[float], q: float | None = None) -> float:
        values = [v * 1e3 for v in values]
        return statistics.mean(values) if q is None else percentile(values, q)

    def ttft(turns: list[TurnResult]) -> dict:
        values = [r.ttft for r in turns]
        if not values:
            return {"requests": 0}
        return {
            "requests": len(values),
            "mean_prompt_len": statistics.mean(r.prompt_len for r in turns),
            "mean": ms(values),
            "p50": ms(values, 50),
            "p90": ms(values, 90),
        }

    return {
        "system": name,
        "decode_prefix_reuse": mode.decode_prefix_reuse,
        "kv_host_bytes": args.kv_host_bytes if mode.tiers else 0,
        "local_prefill_max_uncached_tokens": (
            args.local_prefill_max_uncached if mode.placement else 0
        ),
        "linear_snapshot_interval": mode.snapshot_interval,
        "block_size": block_size,
        "requests": n,
        **counted,
        "prompt_tokens": sum(r.prompt_len for r in results),
        "block_bytes": block_bytes,
        "kv_bytes_per_request": counted["blocks_received"] * block_bytes / n,
        "ttft_ms": {
            "mean": ms([r.ttft for r in results]),
            "p50": ms([r.ttft for r in results], 50),
            "p90": ms([r.ttft for r in results], 90),
        },
        "first_gap_ms": {
            "mean": ms([r.first_gap for r in results]),
            "p50": ms([r.first_gap for r in results], 50),
            "p90": ms([r.first_gap for r in results], 90),
            "later_turns_mean": ms([r.first_gap for r in later]) if later else 0.0,
        },
        "first_turn_ttft_ms": ttft(first),
        "later_turns_ttft_ms": ttft(later),
        "latency_ms_mean": ms([r.latency for r in results]),
        "mean_prompt_len": statistics.mean(r.prompt_len for r in results),
        "outputs": [r.output for r in results],
        "turns": [{k: v for k, v in asdict(r).items() if k != "output"} for r in results],
    }


def served_block_size(model: str, block_size: int) -> int:
    """The block size the nodes run with: the one asked for, raised for a linear-attention
    hybrid until a page holds a state (as the engine does)."""
    return fitted_block_size(ModelConfig.from_pretrained(resolve_model_dir(model)), block_size)


def kv_block_bytes(model: str, block_size: int) -> int:
    """Bytes of one KV block of the model on CPU (float32), all layers and planes (a hybrid's:
    one KV group's, at the block size the nodes run with)."""
    cfg = ModelConfig.from_pretrained(resolve_model_dir(model))
    return KVLayout.for_model(cfg, fitted_block_size(cfg, block_size), "float32").bytes_per_block


# The docs' name of each mode.
MODE_NAMES = {
    "reuse-on": "reuse on",
    "reuse-off": "reuse off",
    "tiers": "tiers",
    "tiers+placement": "tiers + placement",
    "no-snapshots": "no snapshots",
}


def docs_table(*results: dict, columns: str = "tiers", digits: str = "0") -> str:
    """The docs' table of one or more results files, a row per mode run: `columns=tiers` with
    the prompt tokens computed and the blocks loaded from tiers, `columns=reuse` without them and
    with the run's number (its file's place among `results`); times with `digits` decimals."""
    tiers, d = columns == "tiers", int(digits)
    head = ["mode", "requests"]
    if tiers:
        head.append("prompt tokens computed")
    head += ["KV blocks received", "blocks found cached"]
    if tiers:
        head.append("blocks loaded from tiers")
    head += ["KV bytes per request", "TTFT mean / P50 / P90 (ms)"]
    head.append("first-to-second token mean / P50 / P90 (ms)")
    if not tiers:
        head.insert(0, "run")
    align = {"run": "---", "mode": "---"}
    align |= {h: "---" for h in head if "(ms)" in h}
    rows = [
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(align.get(h, "---:") for h in head) + " |",
    ]

    def three(t: dict) -> str:
        return " / ".join(f"{t[q]:.{d}f}" for q in ("mean", "p50", "p90"))

    for number, result in enumerate(results, 1):
        for r in result["runs"]:
            cells = [str(number)] if not tiers else []
            cells += [MODE_NAMES.get(r["system"], r["system"]), str(r["requests"])]
            if tiers:
                cells.append(f"{r['prompt_tokens_computed']:,} of {r['prompt_tokens']:,}")
            cells += [f"{r['blocks_received']:,}", f"{r['blocks_reused']:,}"]
            if tiers:
                cells.append(f"{r['tier_blocks_loaded']:,}")
            cells += [f"{r['kv_bytes_per_request'] / 1024:.1f} KiB", three(r["ttft_ms"])]
            cells.append(three(r["first_gap_ms"]))
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def snapshot_table(*results: dict, digits: str = "0") -> str:
    """The docs' table of state snapshots, a row per mode run with the run's number (its file's
    place among `results`): the prompt tokens computed, the blocks cached at the end, the first
    and the later turns' TTFT, and the later turns' TTFT of the file's no-snapshots runs (their
    mean) over this row's; times with `digits` decimals."""
    d = int(digits)
    head = [
        "run",
        "mode",
        "snapshot interval",
        "block tokens",
        "requests (later turns)",
        "later turns' mean prompt",
        "prompt tokens computed",
        "blocks cached at the end",
        "first turn TTFT P50 / P90 (ms)",
        "later turns' TTFT P50 / P90 (ms)",
        "no snapshots / this, P50 / P90",
    ]
    rows = [
        "| " + " | ".join(head) + " |",
        "| "
        + " | ".join("---" if h in ("run", "mode") or "(ms)" in h else "---:" for h in head)
        + " |",
    ]
    for number, result in enumerate(results, 1):
        runs = result["runs"]
        baseline = [r["later_turns_ttft_ms"] for r in runs if r["system"] == "no-snapshots"]
        for r in runs:
            first, later = r["first_turn_ttft_ms"], r["later_turns_ttft_ms"]
            ratio = "–"
            if baseline:
                ratio = " / ".join(
                    f"{statistics.mean(b[q] for b in baseline) / later[q]:.2f}x"
                    for q in ("p50", "p90")
                )
            interval = r["linear_snapshot_interval"]
            cells = [
                str(number),
                MODE_NAMES.get(r["system"], r["system"]),
                "default" if interval is None else f"{interval:,}",
                str(r["block_size"]),
                f"{r['requests']} ({later['requests']})",
                f"{later['mean_prompt_len']:,.0f}",
                f"{r['prompt_tokens_computed']:,} of {r['prompt_tokens']:,}",
                f"{r['cached_blocks']:,}",
                f"{first['p50']:.{d}f} / {first['p90']:.{d}f}",
                f"{later['p50']:.{d}f} / {later['p90']:.{d}f}",
                ratio,
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


PROG = "pdserve.bench.multiturn"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.multiturn", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--model",
        default=TINY,
        help="the model every node serves: an embedded one, a bench model ("
        + ", ".join(bench_models.MODELS)
        + "; built on first use) or a checkpoint directory",
    )
    p.add_argument("--transport", default="tcp", help="KV transport between the nodes")
    p.add_argument("--sessions", type=int, default=8, help="chat sessions")
    p.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once")
    p.add_argument("--turns", type=length_range, default=(4, 8), help="turns a session, N or LO:HI")
    p.add_argument(
        "--first-len",
        type=length_range,
        default=(64, 128),
        help="first message's tokens, N or LO:HI",
    )
    p.add_argument(
        "--message-len",
        type=length_range,
        default=(16, 48),
        help="later messages' tokens, N or LO:HI",
    )
    p.add_argument(
        "--output-len", type=length_range, default=(16, 32), help="answer tokens, N or LO:HI"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV blocks of every node")
    p.add_argument(
        "--kv-host-bytes",
        type=int,
        default=256 << 20,
        help="host KV tier of every node in the tiers mode",
    )
    p.add_argument(
        "--modes",
        default="reuse-on,reuse-off",
        help="which servers, in order: " + ", ".join(MODES),
    )
    p.add_argument(
        "--local-prefill-max-uncached",
        type=int,
        default=128,
        help="local_prefill_max_uncached_tokens in the tiers+placement mode",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument(
        "--work-dir", default=None, help="servers' configs and logs (default: a temp dir)"
    )
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(
            f"pdserve.bench.multiturn: error: unknown mode(s) {unknown}; use {list(MODES)}"
        )
    workload = MultiTurnWorkload(
        num_sessions=args.sessions,
        turns=args.turns,
        first_len=args.first_len,
        message_len=args.message_len,
        output_len=args.output_len,
    )
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-multiturn-"))
    model = served_model(args.model)
    record = provenance.start(sys.argv if argv is None else ["python", "-m", PROG, *argv])
    runs = [run_mode(m, args, workload, work, model) for m in modes]
    if len(runs) > 1 and any(r["outputs"] != runs[0]["outputs"] for r in runs):
        raise SystemExit("pdserve.bench.multiturn: error: the modes' greedy outputs differ")
    for r in runs:
        r.pop("outputs")
    results = provenance.finish(record) | {"args": vars(args), "runs": runs}
    if any(MODES[m].snapshot_interval is not None for m in modes):
        print(snapshot_table(results, digits="1"))
    else:
        columns = "tiers" if any(MODES[m].tiers for m in modes) else "reuse"
        print(docs_table(results, columns=columns, digits="1"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
