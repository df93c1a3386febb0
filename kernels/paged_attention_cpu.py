"""Paged attention for CPU tensors without the gather: a C kernel (csrc/paged_attention_cpu.c)
reads each sequence's K/V pages where they lie in the pool, through its block table, with an online
softmax. Built once per machine with the system C compiler into pdserve's cache; where there is no
compiler or the build fails, `available()` is False (the reason logged once) and the torch
reference serves instead. Same semantics as `attention_ref.paged_attention` (the ground truth in the
tests), float32 only."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve.kernels import attention_ref, prefill_attention_cpu

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
# No -ffast-math: the kernel starts maxima at -FLT_MAX and relies on IEEE exp; reassociation alone
# lets the compiler vectorise the dot products.
FLAGS = (
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
)


def _cpu_key() -> str:
    """What the built code depends on besides its source: the compiler's target (-march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
        model = next((line for line in info.splitlines() if line.startswith("model name")), "")
    except OSError:
        flags = model = ""
    return platform.machine() + model + flags


def _library_path(compiler: str, source: Path) -> Path:
    from pdserve import cache_root

    digest = hashlib.sha256(
        source.read_bytes() + " ".join((compiler, *FLAGS)).encode() + _cpu_key().encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"paged_attention_cpu-{digest}.so"


def _library() -> ctypes.CDLL | None:
    return build(SOURCE)


@functools.cache
def build(source: Path) -> ctypes.CDLL | None:
    """The kernel built from `source` (this module's own, or another version of it for a
    side-by-side benchmark), or None where it cannot be built."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.info("CPU paged attention: no C compiler (cc, gcc); the torch reference runs")
        return None
    path = _library_path(compiler, source)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        cmd = [compiler, *FLAGS, str(source), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            first = (done.stderr.strip().splitlines() or ["?"])[0]
            logger.warning(
                "CPU paged attention: build failed (%s); the torch reference runs", first
            )
            return None
        os.replace(tmp, path)  # atomic: processes building at once each get a whole file
    lib = ctypes.CDLL(str(path))
    fn = lib.paged_attention_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    # A kernel built from an older source (a side-by-side benchmark's) may lack the entry point
    # with a layer's window, chunk and sinks, and have the batch one before it, or neither.
    layer_fn = getattr(lib, "paged_attention_f32_layer", None)
    if layer_fn is not None:
        layer_fn.argtypes = (
            [p] * 4 + [i64, p, p, i64, p] + [i64] * 5 + [ctypes.c_float, i64, i64, p, ctypes.c_int]
        )
        layer_fn.restype = ctypes.c_int
    batch_fn = getattr(lib, "paged_attention_f32_batch", None)
    if batch_fn is not None:
        batch_fn.argtypes = (
            [p] * 4 + [i64, p, p, i64, p] + [i64] * 5 + [ctypes.c_float, ctypes.c_int]
        )
        batch_fn.restype = ctypes.c_int
    return lib


# The entry point with a layer's sliding window, local chunk and sinks.
LAYER_ENTRY = "paged_attention_f32_layer"


def available() -> bool:
    return _library() is not None


def _token_positions(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token's sequence and how many cached tokens it attends (its position + 1)."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens, output_size=num_tokens)
    within = torch.arange(num_tokens) - query_start_loc[seq]
    limit = seq_lens.to(torch.int64)[seq] - q_lens[seq] + within + 1
    return seq, limit


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    library: ctypes.CDLL | None = None,
    *,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention_ref.paged_attention`, reading the pool in place (float32 CPU tensors; anything
    else goes to the reference). `library`: a kernel from `build` (default: this one's)."""
    lib = library or _library()
    local = dict(window=window, chunk=chunk, sinks=sinks)
    if (
        lib is None
        or query.dtype != torch.float32
        or k_cache.dtype != torch.float32
        or query.device.type != "cpu"
        or ((window or chunk or sinks is not None) and not hasattr(lib, LAYER_ENTRY))
    ):
        return attention_ref.paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            **local,
        )
    attention_ref.check_visibility(window, chunk, sinks, query.shape[1])
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    if sinks is not None:
        local["sinks"] = sinks.to(torch.float32).contiguous()  # the kernel reads float32
    if max_query_len is not None and max_query_len < prefill_attention_cpu.MIN_QUERY_TOKENS:
        # Decodes and short chunks only (the step's plan knows): no per-sequence look.
        return _in_place(
            lib, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **local
        )
    starts = query_start_loc.cpu().to(torch.int64)
    lens = seq_lens.cpu()
    q_lens = starts[1:] - starts[:-1]
    long = (q_lens >= prefill_attention_cpu.MIN_QUERY_TOKENS).nonzero().flatten().tolist()
    if not long:
        return _in_place(lib, query, k_cache, v_cache, block_tables, lens, starts, scale, **local)
    # Long prefill chunks through SDPA, a sequence at a time; every other row (decodes, short
    # chunks) through the C kernel in one call.
    out = torch.empty_like(query)
    for i in long:
        a, b = int(starts[i]), int(starts[i + 1])
        out[a:b] = prefill_attention_cpu.prefill_attention(
            query[a:b], k_cache, v_cache, block_tables[i], int(lens[i]), scale, **local
        )
    rest = sorted(set(range(len(q_lens))) - set(long))
    if rest:
        rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in rest])
        keep = torch.tensor(rest)
        sub_starts = torch.zeros(len(rest) + 1, dtype=torch.int64)
        sub_starts[1:] = torch.cumsum(q_lens[keep], 0)
        out[rows] = _in_place(
            lib,
            query[rows],
            k_cache,
            v_cache,
            block_tables[keep],
            lens[keep],
            sub_starts,
            scale,
            **local,
        )
    return out


def _in_place(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C kernel over every row, reading the pages where they lie (from each query's first
    visible key). window, chunk and sinks need the layer entry point (`LAYER_ENTRY`)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    lens = seq_lens.to("cpu", torch.int64).contiguous()
    starts = query_start_loc.to("cpu", torch.int64).contiguous()
    if not 0 <= len(starts) - 1 <= len(lens):
        raise ValueError("query_start_loc must hold one offset per sequence and one more")
    # Each token's sequence and key range derived in C: `_token_positions`' tensor ops cost about
    # 17 us for every layer of every step, an eighth of a small decode batch's attention.
    batch = (
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        starts.data_ptr(),
        len(starts) - 1,
        out.data_ptr(),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
    )
    threads = torch.get_num_threads()
    if hasattr(lib, LAYER_ENTRY):
        sinks_ptr = None if sinks is None else sinks.data_ptr()
        failed = lib.paged_attention_f32_layer(*batch, window, chunk, sinks_ptr, threads)
    elif hasattr(lib, "paged_attention_f32_batch"):  # an older source's
        failed = lib.paged_attention_f32_batch(*batch, threads)
    else:  # the oldest sources': each token's sequence and limit from Python
        seq, limit = _token_positions(lens, starts, num_tokens)
        lib.paged_attention_f32(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            seq.data_ptr(),
            limit.data_ptr(),
            out.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            threads,
        )
        return out
    if failed == -2:
        raise MemoryError("CPU paged attention: no memory for the token index")
    if failed:
        raise ValueError("query_start_loc must rise from 0 to the number of query tokens")
    return out
