"""KV tier bandwidth: GB/s of writing n blocks of a Llama-3-8B-shaped layout (32 layers x K/V x 16
tokens x 8 heads x 128 dims) from a node's pool down to its host tier, and of loading them back,
through the tiers' own code (`pdserve.engine.kv.tiers`: a copy job per batch on the tiers'
thread, collected by a poll, as the step loop does), beside a plain copy of the same bytes
between the same two tensors (`copy_` of each block, on the calling thread). On a GPU the pool is
on the device and the host tier pinned; on a CPU both are host memory.

    .venv/bin/python -m pdserve.bench.kv_tiers --out bench/results/kv_tiers_cpu.json

Each figure is the median of --repeats rounds; within a round the tiers' copy and the plain
copy run back to back, in alternating order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.kv.host_tier import HostTier
from pdserve.engine.kv.tiers import KVTiers
from pdserve.tune import provenance


def layout(dtype: str) -> KVLayout:
    return KVLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=dtype)


class Rig:
    """A pool of n blocks, all registered in its prefix cache, and a host tier of n slots."""

    def __init__(self, n: int, device: str, dtype: str) -> None:
        self.layout = layout(dtype)
        self.pool = KVPool(self.layout, n, device=device)
        self.pool.kv.normal_()
        self.block_manager = BlockManager(n, self.layout.block_size)
        self.host = HostTier(self.layout, n * self.layout.bytes_per_block, device != "cpu")
        self.tiers = KVTiers(self.pool, self.block_manager, self.host)
        self.tokens = list(range(n * self.layout.block_size + 1))
        self.table: list[int] = []
        assert self.block_manager.allocate_slots(self.table, n * self.layout.block_size)
        self.n = n

    def sync(self) -> None:
        if self.pool.kv.is_cuda:
            torch.cuda.synchronize()

    def store(self) -> float:
        """Seconds to write every block down through the tiers (a fresh host tier each time)."""
        self.host.clear()
        self._register()
        self.sync()
        start = time.perf_counter()
        self.tiers.store_new()
        while self.tiers.busy:
            self.tiers.wait(1.0)
            self.tiers.poll()
        return time.perf_counter() - start

    def load(self) -> float:
        """Seconds to load every block back through the tiers into the same pool blocks."""
        bm = self.block_manager
        hits = [self.tiers.hit(bm.registered_hash(b), bm.key(b)) for b in self.table]
        assert None not in hits, f"{hits.count(None)} of {self.n} blocks not found below"
        loaded = []
        self.sync()
        start = time.perf_counter()
        self.tiers.load(self.table, hits, loaded.append)
        while not loaded:
            self.tiers.wait(1.0)
            self.tiers.poll()
        seconds = time.perf_counter() - start
        assert loaded == [self.n] and bm is self.block_manager
        return seconds

    def plain(self, down: bool) -> float:
        """Seconds of `copy_` of the same blocks between the same tensors, on this thread."""
        kv, buffer = self.pool.kv, self.host.buffer
        self.sync()
        start = time.perf_counter()
        for slot, block in enumerate(self.table):
            if down:
                buffer[slot].copy_(kv[:, :, block], non_blocking=True)
            else:
                kv[:, :, block].copy_(buffer[slot], non_blocking=True)
        self.sync()
        return time.perf_counter() - start

    def _register(self) -> None:
        """Register the pool's blocks in its prefix cache again, for the tiers to copy down."""
        bm = self.block_manager
        bm.free(self.table)
        bm.reset_prefix_cache()
        self.table = []
        assert bm.allocate_slots(self.table, self.n * self.layout.block_size)
        bm.newly_cached = []
        bm.cache_full_blocks(self.table, self.tokens, self.n * self.layout.block_size)

    def close(self) -> None:
        self.tiers.close()


def measure(rig: Rig, repeats: int) -> dict:
    gb = rig.n * rig.layout.bytes_per_block / 1e9
    times: dict[str, list[float]] = {k: [] for k in ("store", "plain_down", "load", "plain_up")}
    rig.store()  # warm-up: first touches of the host pages
    rig.load()
    for i in range(repeats):
        pairs = [("store", rig.store), ("plain_down", lambda: rig.plain(True))]
        pairs += [("load", rig.load), ("plain_up", lambda: rig.plain(False))]
        if i % 2:
            pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
        for name, fn in pairs:
            times[name].append(fn())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "blocks": rig.n,
        "gb": gb,
        "seconds": times,
        "store_gbps": gb / med["store"],
        "plain_down_gbps": gb / med["plain_down"],
        "load_gbps": gb / med["load"],
        "plain_up_gbps": gb / med["plain_up"],
        "store_of_plain": med["plain_down"] / med["store"],
        "load_of_plain": med["plain_up"] / med["load"],
    }


def docs_table(results: dict) -> str:
    """The docs' table of a results file: per copy size, the tiers' write-down and load-back
    bandwidth beside a plain copy's (`python -m pdserve.bench.docs` renders it)."""
    lines = [
        "| blocks | MiB | write down GB/s | plain copy GB/s | of plain | load back GB/s | "
        "plain copy GB/s | of plain |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['blocks']} | {r['gb'] * 1e9 / 2**20:.0f} | {r['store_gbps']:.2f} "
            f"| {r['plain_down_gbps']:.2f} | {100 * r['store_of_plain']:.0f} % "
            f"| {r['load_gbps']:.2f} | {r['plain_up_gbps']:.2f} | {100 * r['load_of_plain']:.0f} % |"
        )
    return "\n".join(lines)


PROG = "pdserve.bench.kv_tiers"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__)
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 16, 64], help="blocks per copy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="write the results file here")
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    record = provenance.start(sys.argv if argv is None else ["python", "-m", PROG, *argv])
    rows = []
    for n in args.blocks:
        rig = Rig(n, args.device, dtype)
        try:
            rows.append(measure(rig, args.repeats))
        finally:
            rig.close()
    results = provenance.finish(record) | {
        "device": args.device,
        "dtype": dtype,
        "block_bytes": layout(dtype).bytes_per_block,
        "rows": rows,
    }
    print(docs_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
