"""KV transfer throughput: for each transport available here, GB/s of moving n blocks of a
Llama-3-8B-shaped layout (32 layers x K/V x 16 tokens x 8 heads x 128 dims, bf16: 2 MiB a block)
from this process's pool into a receiver's pool in another process, beside the raw copy of the
same bytes on the same path: one plain ZeroMQ send of one buffer (tcp), a memcpy into the shared
segment (shm), a device-to-device copy (cuda_ipc).

    .venv/bin/python -m pdserve.bench.kv_transfer                       # tcp and shm, 1..256 blocks
    .venv/bin/python -m pdserve.bench.kv_transfer --max-blocks 1024 --transports shm
    .venv/bin/python -m pdserve.bench.kv_transfer --transports tcp --security none curve auth-only
    .venv/bin/python -m pdserve.bench.kv_transfer --model DIR             # that model's layout

--model takes a checkpoint directory (or its config.json): its KV layout instead of Llama-3-8B's,
bfloat16 (--dtype), every KV head; a model whose layers mix kinds (sliding windows, chunked
attention) has a block of a page per slot of its largest KV group (`engine.kv.groups`).

--security runs one receiver per mode side by side in the same rounds: none (a cluster run
--insecure), curve (the default: the cluster keys, pages encrypted with CurveZMQ) and auth-only
(kv_encryption = false: senders authenticated, pages in clear).

--mla-compare measures instead what the handoff of one prompt moves with multi-head latent
attention (one latent "head" of 576 per token and layer, no V) beside grouped-query KV of a model
of similar size (DeepSeek-V3 beside Llama-3.1-405B, DeepSeek-V2-Lite beside Qwen2.5-14B; bf16,
16-token blocks): the bytes per prompt token (arithmetic from the layouts) and the time of an
8192-token prompt's KV (--tokens), the two layouts of a pair timed in the same rounds. A pair whose
pools (sender and receiver, both layouts) do not fit this host's available memory is measured at
the longest prompt that fits, and the output says so.

    .venv/bin/python -m pdserve.bench.kv_transfer --mla-compare --out bench/results/kv_transfer_mla.json

--kv-cache-dtype auto fp8 moves the same block counts with the pages of each KV cache dtype
side by side, alternating round by round: auto (--dtype) and fp8 (float8_e4m3fn rows, each with
its float32 scale: head_dim + 4 bytes a row); bytes per token from the layouts, time per transfer;
receivers without keys, integrity on (--security and --integrity are not read).

    .venv/bin/python -m pdserve.bench.kv_transfer --kv-cache-dtype auto fp8 --blocks 1 16 64 256 \
        --patterns contiguous --json bench/results/kv_transfer_fp8.json

A transfer is timed from send() to the sender seeing the receiver's ack (all pages landed);
each point is the median of --repeats runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import zmq

from pdserve.engine.kv.cache import KVLayout
from pdserve.kv_transfer.shm import map_pool
from pdserve.tune import provenance
from pdserve.tune.transfer_probe import SECURITY, TransferProbe

LLAMA3_8B = KVLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
SWEEP = (1, 4, 16, 64, 256, 1024)


def _latent(num_layers: int) -> KVLayout:
    """DeepSeek's MLA cache: one latent of kv_lora_rank 512 + qk_rope_head_dim 64 per token."""
    return KVLayout(num_layers, 16, 1, 512 + 64, "bfloat16", planes=1)


def _gqa(num_layers: int) -> KVLayout:
    """K and V of 8 KV heads of 128 per token."""
    return KVLayout(num_layers, 16, 8, 128, "bfloat16")


# (latent model, its layout, a grouped-query model of similar size, its layout)
MLA_PAIRS: tuple[tuple[str, KVLayout, str, KVLayout], ...] = (
    ("DeepSeek-V3", _latent(61), "Llama-3.1-405B", _gqa(126)),
    ("DeepSeek-V2-Lite", _latent(27), "Qwen2.5-14B", _gqa(48)),
)
PROMPT_TOKENS = 8192
# Host memory the comparison leaves to everything else (staging buffers, the interpreter, others).
MEMORY_MARGIN = 4 << 30


def _raw_sink(address_pipe) -> None:
    """Child process: take [total bytes] then messages (zero-copy) until that many bytes came,
    answer b"ok"; a total of 0 ends it."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address_pipe.send(f"tcp://127.0.0.1:{port}")
    while True:
        total = int.from_bytes(sock.recv(), "little")
        if total == 0:
            break
        got = 0
        while got < total:
            got += len(sock.recv(copy=False))
        sock.send(b"ok")
    sock.close(linger=0)
    ctx.term()


class RawTcp:
    """The same bytes from one contiguous buffer to another process over ZeroMQ, zero-copy, to
    its answer: as one message (the plain send), or cut in messages of `frame_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_raw_sink, args=(child,), daemon=True)
        self.proc.start()
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.PAIR)
        self.sock.connect(parent.recv())
        self.buf = torch.empty(max_bytes, dtype=torch.uint8)
        self.buf.random_(0, 255)

    def run(self, nbytes: int, frame_bytes: int | None = None) -> None:
        step = frame_bytes or nbytes
        self.sock.send(nbytes.to_bytes(8, "little"))
        for lo in range(0, nbytes, step):
            self.sock.send(self.buf[lo : min(nbytes, lo + step)].numpy(), copy=False)
        self.sock.recv()

    def close(self) -> None:
        self.sock.send((0).to_bytes(8, "little"))
        self.proc.join(timeout=30)
        self.sock.close(linger=0)
        self.zctx.term()


class RawMemcpy:
    """One memcpy (numpy's, on this thread) of a contiguous buffer into the receiver's shared
    segment, mapped here too."""

    def __init__(self, info: dict, max_bytes: int, layout: KVLayout) -> None:
        pool = map_pool(info["shm_path"], layout, info["num_blocks"])
        self.dst = pool.view(-1).view(torch.uint8).numpy()
        self.src = torch.empty(max_bytes, dtype=torch.uint8)
        self.src.random_(0, 255)
        self.src = self.src.numpy()

    def run(self, nbytes: int) -> None:
        np.copyto(self.dst[:nbytes], self.src[:nbytes])

    def close(self) -> None:
        del self.dst


class RawDeviceCopy:
    """A device-to-device copy of the same bytes on the sender's GPU."""

    def __init__(self, device: str, max_bytes: int) -> None:
        self.device = device
        self.src = torch.empty(max_bytes, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)

    def run(self, nbytes: int) -> None:
        self.dst[:nbytes].copy_(self.src[:nbytes])
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass


def _block_ids(n: int, total: int, pattern: str, rng: random.Random) -> tuple[list, list]:
    if pattern == "contiguous":
        return list(range(n)), list(range(total - n, total))
    return rng.sample(range(total), n), rng.sample(range(total), n)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    out = fn()
    return out if isinstance(out, float) else time.perf_counter() - t0


def measure(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each path, interleaved round by round so they share the machine's load."""
    for fn in fns.values():
        fn()  # warm-up: first touch of pages, connections
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return times


def per_round(times: dict[str, list[float]], a: str, b: str) -> float | None:
    """Median over rounds of b's time / a's: a's speed relative to b's, each round measured back
    to back."""
    ratios = [tb / ta for ta, tb in zip(times.get(a, []), times.get(b, []))]
    return statistics.median(ratios) if ratios else None


def available_transports() -> list[str]:
    names = ["tcp"]
    if sys.platform.startswith("linux"):
        names.append("shm")
    if torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None:
        names.append("cuda_ipc")
        if torch.cuda.device_count() >= 2:
            names.append("nccl")
    return names


def model_layout(model: str, dtype: str) -> KVLayout:
    """A checkpoint's KV layout (its directory or config.json): every KV head, 16-token blocks,
    its layers' kinds where they mix."""
    from pathlib import Path

    from pdserve.engine.models.config import ModelConfig

    path = Path(model)
    config = path.parent if path.name == "config.json" else path
    return KVLayout.for_model(ModelConfig.from_pretrained(config), 16, dtype)


def bytes_per_token(layout: KVLayout) -> int:
    """What the handoff moves per prompt token: every layer's planes x heads x width."""
    return layout.bytes_per_block // layout.block_size


def available_bytes() -> int:
    """Host memory available now, less the margin the comparison leaves (/proc/meminfo)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        kib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // 1024
    return max(0, kib * 1024 - MEMORY_MARGIN)


def fitting_tokens(layouts: list[KVLayout], tokens: int, budget: int) -> int:
    """The longest prompt up to `tokens` (whole blocks) whose pools fit in `budget` bytes: one
    sender pool here and one receiver pool in the child for each layout, alive together."""
    per_token = 2 * sum(bytes_per_token(lay) for lay in layouts)
    block = max(lay.block_size for lay in layouts)
    return min(tokens, budget // per_token // block * block)


def mla_compare(
    transports: list[str],
    tokens: int,
    patterns: list[str],
    repeats: int,
    chunk_bytes: int,
    pairs: tuple[tuple[str, KVLayout, str, KVLayout], ...] = MLA_PAIRS,
    budget: int | None = None,
) -> dict:
    """Bytes per token of each layout, and each pair's prompt KV moved over each transport, the
    latent and the grouped-query layout timed in the same rounds. Prints the two tables."""
    layouts = []
    for mla_name, mla, gqa_name, gqa in pairs:
        for name, lay in ((mla_name, mla), (gqa_name, gqa)):
            layouts.append(
                {
                    "model": name,
                    "attention": "MLA" if lay.planes == 1 else "GQA",
                    "layout": lay.to_dict(),
                    "bytes_per_token": bytes_per_token(lay),
                }
            )
    print(mla_layouts_table({"layouts": layouts}, tokens=str(tokens)), flush=True)
    rng = random.Random(0)
    transfers, shortened = [], []
    for mla_name, mla, gqa_name, gqa in pairs:
        room = available_bytes() if budget is None else budget
        n_tokens = fitting_tokens([mla, gqa], tokens, room)
        if n_tokens < tokens:
            need = 2 * tokens * (bytes_per_token(mla) + bytes_per_token(gqa))
            note = (
                f"{mla_name} / {gqa_name}: {tokens} tokens need {need / 2**30:.1f} GiB of pools "
                f"(sender and receiver, both layouts) and {room / 2**30:.1f} GiB are available: "
                f"measured at {n_tokens} tokens"
            )
            print(f"# {note}", flush=True)
            shortened.append(note)
        if n_tokens <= 0:
            continue
        blocks = n_tokens // mla.block_size
        for transport in transports:
            device = "cuda:0" if transport in ("cuda_ipc", "nccl") else "cpu"
            probes = {}
            try:
                for name, lay in ((mla_name, mla), (gqa_name, gqa)):
                    probes[name] = TransferProbe(transport, lay, blocks, device, chunk_bytes)
                for pattern in patterns:
                    src, dst = _block_ids(blocks, blocks, pattern, rng)
                    fns = {name: partial(probe.run, src, dst) for name, probe in probes.items()}
                    times = measure(fns, repeats)
                    row = {"transport": transport, "pattern": pattern, "tokens": n_tokens}
                    for side, name, lay in (("mla", mla_name, mla), ("gqa", gqa_name, gqa)):
                        nbytes = n_tokens * bytes_per_token(lay)
                        row[side] = {
                            "model": name,
                            "bytes": nbytes,
                            "seconds": statistics.median(times[name]),
                            "GB/s": nbytes / statistics.median(times[name]) / 1e9,
                            "times_s": times[name],
                        }
                    row["gqa_over_mla_bytes"] = row["gqa"]["bytes"] / row["mla"]["bytes"]
                    # median over rounds of the GQA transfer's time over the latent one's
                    row["gqa_over_mla_time"] = per_round(times, mla_name, gqa_name)
                    transfers.append(row)
            finally:
                for probe in probes.values():
                    probe.close()
    print()
    print(mla_transfers_table({"transfers": transfers}))
    return {"layouts": layouts, "transfers": transfers, "shortened": shortened}


KV_CACHE_DTYPES = {"auto": None, "fp8": "fp8_e4m3"}  # --kv-cache-dtype -> the layout's dtype


def with_kv_cache_dtype(layout: KVLayout, kv_cache_dtype: str) -> KVLayout:
    """`layout` as a pool of `--kv-cache-dtype` holds it: auto keeps its dtype, fp8 stores
    float8_e4m3fn rows with their float32 scales (head_dim + 4 bytes a row)."""
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return layout if dtype is None else KVLayout.from_dict({**layout.to_dict(), "dtype": dtype})


def kv_dtype_compare(
    transports: list[str],
    layout: KVLayout,
    sweep: list[int],
    patterns: list[str],
    repeats: int,
    chunk_bytes: int,
    kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8"),
) -> dict:
    """The same block counts moved with each `--kv-cache-dtype`'s pages, the dtypes timed in
    the same rounds (alternating), over each transport: bytes per token (the layouts' arithmetic)
    and seconds per transfer. Prints the table."""
    layouts = {d: with_kv_cache_dtype(layout, d) for d in kv_cache_dtypes}
    base = kv_cache_dtypes[0]
    rng = random.Random(0)
    rows = []
    for transport in transports:
        device = "cuda:0" if transport in ("cuda_ipc", "nccl") else "cpu"
        probes = {}
        try:
            for name, lay in layouts.items():
                probes[name] = TransferProbe(transport, lay, max(sweep), device, chunk_bytes)
            for pattern in patterns:
                for n in sweep:
                    src, dst = _block_ids(n, max(sweep), pattern, rng)
                    fns = {name: partial(probe.run, src, dst) for name, probe in probes.items()}
                    times = measure(fns, repeats)
                    row = {"transport": transport, "pattern": pattern, "blocks": n}
                    for name, lay in layouts.items():
                        seconds = statistics.median(times[name])
                        row[name] = {
                            "dtype": lay.dtype,
                            "bytes_per_token": bytes_per_token(lay),
                            "bytes": n * lay.bytes_per_block,
                            "seconds": seconds,
                            "GB/s": n * lay.bytes_per_block / seconds / 1e9,
                            "times_s": times[name],
                        }
                        if name != base:
                            # median over rounds of this dtype's time over the first one's
                            row[name]["time_over_" + base] = per_round(times, base, name)
                            row[name]["bytes_over_" + base] = (
                                row[name]["bytes"] / row[base]["bytes"]
                            )
                    rows.append(row)
                    print(f"# {transport} {pattern} {n} blocks: measured", flush=True)
        finally:
            for probe in probes.values():
                probe.close()
    results = {
        "kv_cache_dtypes": {
            name: {"layout": lay.to_dict(), "bytes_per_token": bytes_per_token(lay)}
            for name, lay in layouts.items()
        },
        "rows": rows,
    }
    print(kv_dtype_table(results))
    return results


# --- the docs' tables (`python -m pdserve.bench.docs` renders them from the results files) -----


def _points(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The rows of each measured point (transport, pattern, blocks), in the order measured."""
    points: dict[tuple, list[dict]] = {}
    for row in rows:
        points.setdefault((row["transport"], row["pattern"], row["blocks"]), []).append(row)
    return points


def _vs(row: dict) -> float | None:
    """The row's time relative to the run's first variant (the key names that variant)."""
    return next((v for k, v in row.items() if k.startswith("vs ")), None)


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def transfer_table(results: dict) -> str:
    """One variant's transfers beside the raw copy of the same bytes: the one-message send (tcp)
    or memcpy (shm), and the same bytes in chunk-sized messages (tcp)."""
    chunk = results.get("settings", {}).get("chunk_mib", 8.0)
    out = [
        "| transport | blocks | ids | MiB | transfer GB/s | raw GB/s (1 message / memcpy) | "
        f"ratio | raw GB/s ({chunk:g} MiB messages) | ratio |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (transport, pattern, blocks), rows in _points(results["rows"]).items():
        cells = [transport, str(blocks), pattern, f"{rows[0]['MiB']:.0f}", f"{rows[0]['GB/s']:.2f}"]
        for row in rows[:2]:
            cells += [f"{row['raw GB/s']:.2f}" if row["raw GB/s"] else "", _pct(row["ratio"])]
        cells += ["", ""] * (2 - len(rows[:2]))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _verdict(ratios: list[float], target: float) -> str:
    return "met" if min(ratios) >= target else "missed"


def _span(values: list[float], fmt: str = ".0%") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} to {hi:{fmt}}"


def transfer_points(results: dict, target: str = "0.8", from_blocks: str = "64") -> str:
    """The transfer table against its target (a share of the raw path from some size up), and
    the small transfers' latency, in words; every figure from the run's rows."""
    goal, least = float(target), int(from_blocks)
    rows = results["rows"]

    def ratios(transport: str, raw: str, pattern: str | None = None) -> list[float]:
        return [
            r["ratio"]
            for r in rows
            if r["transport"] == transport
            and r["raw"].startswith(raw)
            and r["blocks"] >= least
            and (pattern is None or r["pattern"] == pattern)
        ]

    one = ratios("tcp", "zmq send, 1 message")
    chunked_rows = [
        r
        for r in rows
        if r["transport"] == "tcp" and "MiB messages" in r["raw"] and r["blocks"] >= least
    ]
    chunked = [r["ratio"] for r in chunked_rows]
    meeting = [f"{r['blocks']} {r['pattern']}" for r in chunked_rows if r["ratio"] >= goal]
    shm_c, shm_r = ratios("shm", "memcpy", "contiguous"), ratios("shm", "memcpy", "random")
    small = [r for r in rows if r["blocks"] <= 4 and r["raw"] in ("memcpy", "zmq send, 1 message")]
    ms = [r["MiB"] * 2**20 / r["GB/s"] / 1e6 for r in small]
    raw_ms = [r["MiB"] * 2**20 / r["raw GB/s"] / 1e6 for r in small if r["raw GB/s"]]
    lines = [
        f"Against the target (at least {goal:.0%} of the raw path from {least} blocks up):",
        "",
        f"- **tcp, against the plain one-message send: {_verdict(one, goal)}** ({_span(one)}). "
        "That baseline is weak: the receiving libzmq allocates, and the kernel faults in, a fresh "
        "n-byte buffer per message. **Against chunk-sized messages of the same bytes: "
        f"{_verdict(chunked, goal)}** ({_span(chunked)}"
        + (f"; met at {', '.join(meeting)} blocks" if meeting and min(chunked) < goal else "")
        + "). On two shared cores every copy competes with the kernel's two socket copies: the "
        "transfer adds a scatter on the receiver (pages land in blocks, not in a fresh buffer) "
        "and, for scattered source blocks, a gather on the sender. Contiguous source runs are "
        "sent straight from the pool (no gather) for that reason. Where cores are not the "
        "bottleneck (a NIC is), the two copies overlap the wire and should cost little; that is "
        "not shown here.",
        f"- **shm: {_verdict(shm_c + shm_r, goal)}**: {_span(shm_c)} for contiguous blocks, "
        f"{_span(shm_r)} for random ones. The raw path is one streaming memcpy; the transfer "
        "copies one page row per (layer, K/V, run of blocks), 32 KiB per page here, through a "
        "2 MiB cache-resident scratch buffer when blocks are scattered (pool layout [layer, K/V, "
        "block, ...] puts each page of a block in a different place).",
        f"- Small transfers (1 and 4 blocks) took {_span(ms, '.1f')} ms each, against "
        f"{_span(raw_ms, '.2f')} ms for the raw copy (one message or memcpy): they are "
        "latency-bound, by the handoffs between the caller, the sender and receiver threads and "
        "the acks (two round trips for shm: Begin/Go, Done/Ack).",
    ]
    return "\n".join(lines)


def security_table(results: dict) -> str:
    """Receivers of each security mode side by side: GB/s, and the first mode's time over each
    other's (its relative speed), with the raw path of the same bytes."""
    points = _points(results["rows"])
    modes = list(dict.fromkeys(row["security"] for row in results["rows"]))
    cols = " | ".join(
        f"{m} GB/s" + ("" if m == modes[0] else f" | {m} / {modes[0]}") for m in modes
    )
    out = [
        f"| transport | blocks | pattern | MiB | {cols} | raw path | raw GB/s |",
        "| --- | ---: | --- | ---: |" + " ---: |" * (2 * len(modes) - 1) + " --- | ---: |",
    ]
    for (transport, pattern, blocks), rows in points.items():
        by_mode = {row["security"]: row for row in rows}
        cells = [transport, str(blocks), pattern, f"{rows[0]['MiB']:.0f}"]
        for m in modes:
            cells.append(f"{by_mode[m]['GB/s']:.2f}")
            if m != modes[0]:
                cells.append(_pct(_vs(by_mode[m])))
        raw_gbs = rows[0]["raw GB/s"]
        cells += [rows[0]["raw"], f"{raw_gbs:.2f}" if raw_gbs else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def integrity_table(results: dict, security: str = "none") -> str:
    """Transfers with and without the pages' digest, side by side, under one security mode; the
    last column is the median over rounds of the time with it over the time without."""
    out = [
        "| transport | blocks | pattern | MiB | integrity on GB/s | integrity off GB/s "
        "| time on / off |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    rows = [row for row in results["rows"] if row["security"] == security]
    for (transport, pattern, blocks), point in _points(rows).items():
        on = next(row for row in point if row["integrity"])
        off = next(row for row in point if not row["integrity"])
        cells = [transport, str(blocks), pattern, f"{on['MiB']:.0f}"]
        cells += [f"{on['GB/s']:.2f}", f"{off['GB/s']:.2f}", _pct(_vs(off))]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _security_range(results: dict, transport: str, mode: str) -> dict[str, float]:
    """Over every point of a transport: the keyed mode's rate relative to the insecure one, its
    GB/s and the insecure GB/s, as (least, most)."""
    rows = [r for r in results["rows"] if r["transport"] == transport]
    keyed = [r for r in rows if r["security"] == mode]
    base = [r for r in rows if r["security"] == rows[0]["security"]]
    rel = [_vs(r) for r in keyed]
    return {
        "rel": (min(rel), max(rel)),
        "gbs": (min(r["GB/s"] for r in keyed), max(r["GB/s"] for r in keyed)),
        "base_gbs": (min(r["GB/s"] for r in base), max(r["GB/s"] for r in base)),
    }


def security_summary(results: dict, transport: str = "tcp", mode: str = "curve") -> str:
    """One sentence: a keyed mode's rate against the insecure one over a transport, the range
    over every point of the run."""
    r = _security_range(results, transport, mode)
    what = {"curve": "with CurveZMQ", "auth-only": "authenticated only"}.get(mode, mode)
    return (
        f"In that run, {transport} transfers {what} ran at {r['rel'][0]:.0%} to "
        f"{r['rel'][1]:.0%} of their unencrypted rate ({r['gbs'][0]:.2f} to {r['gbs'][1]:.2f} "
        f"GB/s against {r['base_gbs'][0]:.2f} to {r['base_gbs'][1]:.2f} GB/s)."
    )


def security_points(results: dict, prompt_blocks: str = "64") -> str:
    """The security table's points in words, each range over every point of the run."""
    curve = _security_range(results, "tcp", "curve")
    auth = _security_range(results, "tcp", "auth-only")
    shm_curve = _security_range(results, "shm", "curve")
    shm_auth = _security_range(results, "shm", "auth-only")
    n = int(prompt_blocks)
    at_n = [r for r in results["rows"] if r["transport"] == "tcp" and r["blocks"] == n]
    mib = at_n[0]["MiB"]

    def seconds(mode: str) -> tuple[float, float]:
        rates = [r["GB/s"] for r in at_n if r["security"] == mode]
        return mib * 2**20 / max(rates) / 1e9, mib * 2**20 / min(rates) / 1e9

    enc, clear = seconds("curve"), seconds(at_n[0]["security"])
    block_mib = mib / n
    block_size = results.get("settings", {}).get("layout", {}).get("block_size", 16)
    return "\n".join(
        [
            f"- **tcp with CurveZMQ runs at {curve['rel'][0]:.0%} to {curve['rel'][1]:.0%} of the "
            f"insecure rate** ({curve['gbs'][0]:.2f} to {curve['gbs'][1]:.2f} GB/s against "
            f"{curve['base_gbs'][0]:.2f} to {curve['base_gbs'][1]:.2f} GB/s): libzmq encrypts "
            "and authenticates every message (XSalsa20-Poly1305) on its one I/O thread, which "
            f"becomes the bottleneck. For a Llama-3-8B-shaped KV of {block_mib:g} MiB a block, "
            f"a prompt of {n} blocks ({n * block_size:,} tokens, {mib:.0f} MiB) took {enc[0]:.2f} to "
            f"{enc[1]:.2f} s to cross encrypted here against {clear[0]:.2f} to {clear[1]:.2f} s "
            "in clear.",
            f"- **auth-only** ran at {auth['rel'][0]:.0%} to {auth['rel'][1]:.0%} of the "
            "insecure rate over tcp: the password is checked once per connection, the pages "
            "travel as they would without keys.",
            f"- **shm** ran at {shm_curve['rel'][0]:.0%} to {shm_curve['rel'][1]:.0%} of the "
            f"insecure rate with CurveZMQ and {shm_auth['rel'][0]:.0%} to "
            f"{shm_auth['rel'][1]:.0%} authenticated only, single points straying both ways: "
            "its pages move through shared memory, and only its control messages cross the "
            "keyed socket.",
        ]
    )


def mla_layouts_table(results: dict, tokens: str | None = None) -> str:
    """Bytes per token of each layout, and of a prompt of the run's length."""
    n = int(tokens or results["settings"]["tokens"])
    out = [
        "| model | attention | layers | per token and layer (planes × heads × width) | "
        f"bytes / token | KiB / token | {n}-token KV MiB |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for row in results["layouts"]:
        lay = row["layout"]
        what = "latent" if lay["planes"] == 1 else "K and V"
        shape = f"{lay['planes']} × {lay['num_kv_heads']} × {lay['head_dim']} ({what})"
        bpt = row["bytes_per_token"]
        out.append(
            f"| {row['model']} | {row['attention']} | {lay['num_layers']} | {shape} | {bpt:,} | "
            f"{bpt / 1024:.1f} | {n * bpt / 2**20:,.0f} |"
        )
    return "\n".join(out)


def mla_transfers_table(results: dict) -> str:
    """Each pair's prompt KV moved over each transport, latent and GQA in the same rounds."""
    out = [
        "| transport | block ids | MLA model | MiB | ms | GQA model | MiB | ms | GQA / MLA bytes "
        "| GQA / MLA time |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in results["transfers"]:
        m, g = row["mla"], row["gqa"]
        out.append(
            f"| {row['transport']} | {row['pattern']} | {m['model']} | {m['bytes'] / 2**20:,.0f} "
            f"| {m['seconds'] * 1e3:,.0f} | {g['model']} | {g['bytes'] / 2**20:,.0f} | "
            f"{g['seconds'] * 1e3:,.0f} | {row['gqa_over_mla_bytes']:.2f}x | "
            f"{row['gqa_over_mla_time']:.2f}x |"
        )
    return "\n".join(out)


def kv_dtype_table(results: dict) -> str:
    """Each point's transfer with each `--kv-cache-dtype`, timed in the same rounds: ms per
    transfer, and the others' bytes and time relative to the first's."""
    names = list(results["kv_cache_dtypes"])
    base = names[0]
    cols = " | ".join(
        f"{d} MiB | {d} ms" + ("" if d == base else f" | {d} / {base} bytes | {d} / {base} time")
        for d in names
    )
    out = [
        f"| transport | block ids | blocks | {cols} |",
        "| --- | --- | ---: |" + " ---: |" * (2 + 4 * (len(names) - 1)),
    ]
    for row in results["rows"]:
        cells = [row["transport"], row["pattern"], str(row["blocks"])]
        for d in names:
            cells += [f"{row[d]['bytes'] / 2**20:,.1f}", f"{row[d]['seconds'] * 1e3:,.1f}"]
            if d != base:
                cells += [
                    f"{row[d]['bytes_over_' + base]:.3f}",
                    _pct(row[d]["time_over_" + base]),
                ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def kv_dtype_bytes(results: dict) -> str:
    """Bytes per token of each `--kv-cache-dtype`'s layout, the run's layout's arithmetic."""
    out = [
        "| --kv-cache-dtype | page dtype | layers | per token and layer (K/V × heads × row bytes) "
        "| bytes / token |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for name, entry in results["kv_cache_dtypes"].items():
        lay = KVLayout.from_dict(entry["layout"])
        row = lay.page_width * torch.tensor([], dtype=lay.torch_dtype).element_size()
        out.append(
            f"| {name} | {lay.dtype} | {lay.num_layers} | {lay.planes} × {lay.num_kv_heads} × "
            f"{row} | {entry['bytes_per_token']:,} |"
        )
    return "\n".join(out)


def kv_dtype_points(results: dict, from_blocks: str = "16") -> str:
    """The dtype table in words: the second dtype's bytes and time relative to the first's from
    some block count up, per transport, and the single blocks'; every figure from the rows."""
    names = list(results["kv_cache_dtypes"])
    base, other = names[0], names[1]
    least = int(from_blocks)
    sizes = {d: results["kv_cache_dtypes"][d]["bytes_per_token"] for d in names}
    lines = [
        f"- **Bytes: {other} moves {sizes[other] / sizes[base]:.3f} of {base}'s** "
        f"({sizes[other]:,} against {sizes[base]:,} bytes per token), exact whatever the machine.",
    ]
    for transport in dict.fromkeys(r["transport"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["transport"] == transport]
        big = [r[other]["time_over_" + base] for r in rows if r["blocks"] >= least]
        small = [r[other]["time_over_" + base] for r in rows if r["blocks"] < least]
        lines.append(
            f"- **{transport}, {least} blocks and more: {other} took {_span(big)} of {base}'s "
            f"time** (median {statistics.median(big):.0%})"
            + (f"; below {least} blocks {_span(small)}" if small else "")
            + "."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", nargs="*", default=None, help="default: all available")
    ap.add_argument("--max-blocks", type=int, default=256, help="largest point of the sweep")
    ap.add_argument("--blocks", type=int, nargs="*", default=None, help="the sweep itself")
    ap.add_argument("--patterns", nargs="*", default=["contiguous", "random"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-mib", type=float, default=8.0, help="tcp / nccl chunk size")
    ap.add_argument(
        "--security",
        nargs="+",
        choices=list(SECURITY),
        default=["none"],
        help="how receivers admit senders; several: measured side by side",
    )
    ap.add_argument(
        "--integrity",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="senders digest their pages and receivers check them (on: every node's default); "
        "both: measured side by side",
    )
    ap.add_argument(
        "--mla-compare",
        action="store_true",
        help="bytes per token and a prompt's transfer time, latent (MLA) beside GQA layouts",
    )
    ap.add_argument(
        "--tokens", type=int, default=PROMPT_TOKENS, help="--mla-compare: the prompt's tokens"
    )
    ap.add_argument(
        "--model", default=None, help="a checkpoint directory: its KV layout, not Llama-3-8B's"
    )
    ap.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=list(KV_CACHE_DTYPES),
        default=None,
        help="the pages each KV cache dtype stores (auto: --dtype; fp8: float8 rows with their "
        "scales); several: measured side by side in alternating rounds",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--json", "--out", dest="json", default=None, help="also write the results here"
    )
    args = ap.parse_args(argv)

    transports = args.transports or available_transports()
    if args.mla_compare:
        _run_mla_compare(args, transports, argv)
        return
    if args.kv_cache_dtype:
        _run_kv_dtype_compare(args, transports, argv)
        return
    sweep = args.blocks or [n for n in SWEEP if n <= args.max_blocks]
    record = provenance.start([__file__, *argv])
    record["machine"]["zmq"] = f"{zmq.pyzmq_version()} / libzmq {zmq.zmq_version()}"
    max_blocks = max(sweep)
    layout = model_layout(args.model, args.dtype) if args.model else LLAMA3_8B
    block = layout.bytes_per_block
    nbytes_list = [n * block for n in sweep]
    rng = random.Random(0)
    torch.manual_seed(0)
    integrities = list(dict.fromkeys(args.integrity))
    # Each variant a sender and receiver pair: a security, with integrity on or off.
    variants = {
        (s if len(integrities) == 1 else f"{s}, integrity {i}"): (s, i == "on")
        for s in dict.fromkeys(args.security)
        for i in integrities
    }
    securities = list(variants)  # the variants' labels, the first the baseline
    side_by_side = len(securities) > 1
    print(f"# {record['command']}")
    print(f"# layout {layout.to_dict()}, {block / 2**20:.3g} MiB per block")
    chunk_bytes = int(args.chunk_mib * 2**20)
    rows = []
    for transport in transports:
        device = "cuda:0" if transport in ("cuda_ipc", "nccl") else "cpu"
        benches = {
            label: TransferProbe(
                transport, layout, max_blocks, device, chunk_bytes, security, integrity
            )
            for label, (security, integrity) in variants.items()
        }
        info = benches[securities[0]].remote.info
        if transport == "tcp":
            raw = RawTcp(max(nbytes_list))
            raws = {
                "zmq send, 1 message": raw.run,
                f"zmq send, {args.chunk_mib:g} MiB messages": partial(
                    raw.run, frame_bytes=chunk_bytes
                ),
            }
            if side_by_side:  # the baseline with the transfer's own message sizes
                raws = dict(list(raws.items())[1:])
        elif transport == "shm":
            raw = RawMemcpy(info, max(nbytes_list), layout)
            raws = {"memcpy": raw.run}
        elif transport == "cuda_ipc":
            raw = RawDeviceCopy(device, max(nbytes_list))
            raws = {"d2d copy": raw.run}
        else:
            raw, raws = None, {}
        try:
            for pattern in args.patterns:
                for n, nbytes in zip(sweep, nbytes_list):
                    src, dst = _block_ids(n, max_blocks, pattern, rng)
                    fns = {s: partial(b.run, src, dst) for s, b in benches.items()}
                    fns.update({name: partial(f, nbytes) for name, f in raws.items()})
                    times = measure(fns, args.repeats)
                    gbs = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
                    base = securities[0]
                    for security in securities:
                        for name in raws or {"-": None}:
                            rows.append(
                                {
                                    "transport": transport,
                                    "security": variants[security][0],
                                    "integrity": variants[security][1],
                                    "pattern": pattern,
                                    "blocks": n,
                                    "MiB": nbytes / 2**20,
                                    "GB/s": gbs[security],
                                    "raw": name,
                                    "raw GB/s": gbs.get(name),
                                    # median over rounds of raw time / transfer time, each round
                                    # measured back to back
                                    "ratio": per_round(times, security, name),
                                    f"vs {base}": per_round(times, security, base),
                                    "times_s": times[security],
                                    "raw_times_s": times.get(name),
                                }
                            )
                    print(f"# {transport} {pattern} {n} blocks: measured", flush=True)
        finally:
            if raw is not None:
                raw.close()
            for bench in benches.values():
                bench.close()
    results = provenance.finish(record) | {
        "settings": {
            "transports": transports,
            "blocks": sweep,
            "patterns": args.patterns,
            "repeats": args.repeats,
            "chunk_mib": args.chunk_mib,
            "security": list(dict.fromkeys(args.security)),
            "integrity": integrities,
            "layout": layout.to_dict(),
            **({"model": args.model} if args.model else {}),
        },
        "rows": rows,
    }
    if not side_by_side:
        print(transfer_table(results))
    elif len(integrities) > 1:
        for security in dict.fromkeys(args.security):
            print(integrity_table(results, security=security))
    else:
        print(security_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _run_mla_compare(args: argparse.Namespace, transports: list[str], argv: list[str]) -> None:
    record = provenance.start([__file__, *argv])
    record["machine"]["zmq"] = f"{zmq.pyzmq_version()} / libzmq {zmq.zmq_version()}"
    print(f"# {record['command']}")
    here = available_transports()
    not_run = {
        t: "not asked (--transports)" if t in here else "needs CUDA and CuPy (nccl: 2 GPUs)"
        for t in ("tcp", "shm", "cuda_ipc", "nccl")
        if t not in transports
    }
    results = mla_compare(
        transports,
        args.tokens,
        args.patterns,
        args.repeats,
        int(args.chunk_mib * 2**20),
    )
    if not_run:
        print(f"# not measured: {'; '.join(f'{t}: {why}' for t, why in not_run.items())}")
    if args.json:
        out = provenance.finish(record) | {
            "settings": {
                "transports": transports,
                "tokens": args.tokens,
                "patterns": args.patterns,
                "repeats": args.repeats,
                "chunk_mib": args.chunk_mib,
                "memory_margin_gib": MEMORY_MARGIN / 2**30,
            },
            "not_measured": not_run,
            **results,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _run_kv_dtype_compare(args: argparse.Namespace, transports: list[str], argv: list[str]) -> None:
    record = provenance.start([__file__, *argv])
    record["machine"]["zmq"] = f"{zmq.pyzmq_version()} / libzmq {zmq.zmq_version()}"
    print(f"# {record['command']}")
    sweep = args.blocks or [n for n in SWEEP if n <= args.max_blocks]
    layout = model_layout(args.model, args.dtype) if args.model else LLAMA3_8B
    layout = KVLayout.from_dict({**layout.to_dict(), "dtype": args.dtype})
    results = kv_dtype_compare(
        transports,
        layout,
        sweep,
        args.patterns,
        args.repeats,
        int(args.chunk_mib * 2**20),
        tuple(dict.fromkeys(args.kv_cache_dtype)),
    )
    if args.json:
        out = provenance.finish(record) | {
            "settings": {
                "transports": transports,
                "blocks": sweep,
                "patterns": args.patterns,
                "repeats": args.repeats,
                "chunk_mib": args.chunk_mib,
                "kv_cache_dtype": list(dict.fromkeys(args.kv_cache_dtype)),
                "layout": layout.to_dict(),
                **({"model": args.model} if args.model else {}),
            },
            **results,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
