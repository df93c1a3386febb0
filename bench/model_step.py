"""Whole-model step times against the device's own limits, side by side in one run.

A Llama-3-8B-shaped model with random weights runs its steps through `ModelRunner.run`, as the
engine runs them (batch preparation, the forward, logits, the copy of logits to the host):
- decode: one new token for each of `batch` sequences holding `context` tokens, replayed from a
  CUDA graph and launched eagerly; the bytes a step must read (every weight once, the embedding
  and KV rows it uses) over the step time, as a fraction of a measured device-to-device copy;
- prefill: `prompts` prompts of `prompt_len` tokens in one step, its matmul and attention FLOPs
  over the step time, as a fraction of a measured bf16 matmul.

    python -m pdserve.bench.model_step                                  # on a GPU: Llama-3-8B, bf16
    python -m pdserve.bench.model_step --json out.json --batches 1,64 --contexts 4096
    python -m pdserve.bench.model_step --preset tiny --device cpu       # the script itself, on a CPU
    python -m pdserve.bench.model_step --quick                          # gpu-check's shorter sweep
    python -m pdserve.bench.model_step --tensor-parallel-size 2         # each step over 2 ranks

With --tensor-parallel-size N the model is split over N ranks (processes on devices 0..N-1, gloo
on CPU): every rank runs the same steps on its shard, collectives included, and the tables give
the weights and bytes each rank reads. A combination whose weights and KV do not fit the device
is listed as such and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from pdserve import SOURCE_ROOT
from pdserve.bench.device_limits import DeviceLimits, Results
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.execution.decode_graphs import DecodeGraphs
from pdserve.engine.execution.runner import ModelRunner
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.loader import build_model
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.tp.group import TPGroup, host_store
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.ops import select_ops

PRESETS = {
    # meta-llama/Meta-Llama-3-8B's config.json, weights aside.
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    ),
}
BLOCK_SIZE = 16
# The sweeps: the full one for the docs, the quick one for `make gpu-check`'s time box.
FULL_SWEEP = {
    "batches": [1, 16, 64, 256],
    "contexts": [512, 4096],
    "prefill_prompts": [1, 4],
    "repeats": 20,
}
QUICK_SWEEP = {
    "batches": [1, 64, 256],
    "contexts": [512, 4096],
    "prefill_prompts": [1],
    "repeats": 10,
}


@dataclass(slots=True)
class DecodeStep:
    """A whole decode step, one new token per sequence, against the copy."""

    batch: int
    context: int
    graph_ms: float | None  # per step, forward replayed from a CUDA graph (None off CUDA)
    eager_ms: float  # per step, every kernel launched from Python
    bytes_gb: float  # weights + embedding rows + KV read per step
    gbps: float  # bytes over the faster step time
    fraction_of_copy: float


@dataclass(slots=True)
class PrefillStep:
    """A whole prefill step against the matmul."""

    prompts: int
    prompt_len: int
    ms: float
    tflop: float
    tflops: float
    fraction_of_matmul: float


def model_config(preset: str) -> ModelConfig:
    shape = PRESETS[preset]
    return ModelConfig.from_dict(
        {
            "model_type": "llama",
            "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            **shape,
        }
    )


def random_model(
    cfg: ModelConfig,
    dtype: str,
    device: str,
    seed: int,
    shard: TPShard | None = None,
    group: TPGroup | None = None,
) -> LlamaForCausalLM:
    """Weights ~ N(0, 0.02), norms 1: real data through every kernel (zeros can run faster); a
    tensor-parallel rank's part of them with a shard."""
    model = build_model(cfg, dtype, device, shard, group)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model


# --- device ceilings and timing -----------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(fn, device: str, repeats: int, warmup: int = 3) -> float:
    """Median wall time of fn in ms, the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_limits(
    device: str, dtype: torch.dtype, copy_bytes: int, matmul_n: int, repeats: int
) -> DeviceLimits:
    """The device's copy and matmul, timed as the steps are (`median_ms`)."""
    return DeviceLimits.measure(
        lambda fn: median_ms(fn, device, repeats), device, dtype, copy_bytes, matmul_n
    )


# --- steps --------------------------------------------------------------------------------------


def free_bytes(device: str) -> int | None:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return None


def kv_pool(
    cfg: ModelConfig, dtype: str, num_blocks: int, device: str, shard: TPShard | None = None
) -> KVPool:
    """A pool of random pages, of a rank's KV heads with a shard."""
    heads = len((shard or TPShard()).kv_heads(cfg.cache_heads))
    layout = KVLayout.for_model(cfg, BLOCK_SIZE, dtype, heads)
    pool = KVPool(layout, num_blocks, device)
    pool.kv.normal_()
    return pool


def sequences(
    batch: int, context: int, new_tokens: int, vocab: int, gen: torch.Generator
) -> tuple[list[Sequence], int]:
    """`batch` sequences with `context` tokens computed and `new_tokens` to compute, on shuffled
    pages of one pool (block 0 left unused). Returns them and the pool's block count."""
    blocks = -(-(context + new_tokens) // BLOCK_SIZE)
    num_blocks = batch * blocks + 1
    pages = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    seqs = []
    for b in range(batch):
        tokens = torch.randint(3, vocab, (context + new_tokens,), generator=gen).tolist()
        seq = Sequence(f"s{b}", tokens, params)
        seq.num_computed_tokens = context
        seq.block_table = pages[b * blocks : (b + 1) * blocks]
        seqs.append(seq)
    return seqs, num_blocks


def decode_bytes(model: LlamaForCausalLM, pool: KVPool, batch: int, context: int) -> int:
    """What one decode step must read (on one rank: its shard and its pool's heads): every weight
    once except the embedding table, of which only `batch` rows; every sequence's K and V for
    its context and new token."""
    cfg = model.config
    elem = pool.kv.element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= model.embed_tokens.weight.numel() * elem - batch * cfg.hidden_size * elem
    per_token_kv = cfg.num_layers * 2 * pool.layout.num_kv_heads * cfg.head_dim * elem
    return weights + batch * (context + 1) * per_token_kv


def prefill_flop(cfg: ModelConfig, prompts: int, prompt_len: int) -> float:
    """Matmul FLOPs of the layers for every token, the LM head for each prompt's last token, and
    causal attention (QK^T and PV over the lower triangle)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * inter
    tokens = prompts * prompt_len
    linear = 2 * cfg.num_layers * layer_params * tokens + 2 * h * cfg.vocab_size * prompts
    attention = cfg.num_layers * prompts * 2 * cfg.num_heads * cfg.head_dim * prompt_len**2
    return float(linear + attention)


def bench_decode(
    model: LlamaForCausalLM,
    dtype: str,
    device: str,
    batch: int,
    context: int,
    max_model_len: int,
    limits: DeviceLimits,
    repeats: int,
) -> DecodeStep:
    cfg = model.config
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    seqs, num_blocks = sequences(batch, context, 1, cfg.vocab_size, gen)
    pool = kv_pool(cfg, dtype, num_blocks, device, model.shard)
    runner = ModelRunner(model, pool, select_ops(device), device)
    step = SchedulerOutput(scheduled=[ScheduledSeq(s, 1) for s in seqs])
    eager_ms = median_ms(lambda: runner.run(step), device, repeats)
    graph_ms = None
    if device.startswith("cuda"):
        # One graph, at this batch, over block tables as wide as the engine makes them.
        width = -(-max_model_len // BLOCK_SIZE)
        graphs = DecodeGraphs(model, pool, runner.ops, runner.device, batch, width, [batch])
        graphs.capture()
        runner.decode_graphs = graphs
        graph_ms = median_ms(lambda: runner.run(step), device, repeats)
        assert graphs.replays > 0
    num_bytes = decode_bytes(model, pool, batch, context)
    best = min(eager_ms, graph_ms or eager_ms)
    gbps = num_bytes / (best * 1e-3) / 1e9
    fraction = limits.of_copy(gbps)
    return DecodeStep(batch, context, graph_ms, eager_ms, num_bytes / 1e9, gbps, fraction)


def bench_prefill(
    model: LlamaForCausalLM,
    dtype: str,
    device: str,
    prompts: int,
    prompt_len: int,
    limits: DeviceLimits,
    repeats: int,
) -> PrefillStep:
    cfg = model.config
    gen = torch.Generator().manual_seed(prompts * 7919 + prompt_len)
    seqs, num_blocks = sequences(prompts, 0, prompt_len, cfg.vocab_size, gen)
    pool = kv_pool(cfg, dtype, num_blocks, device, model.shard)
    runner = ModelRunner(model, pool, select_ops(device), device)
    step = SchedulerOutput(scheduled=[ScheduledSeq(s, prompt_len) for s in seqs])
    ms = median_ms(lambda: runner.run(step), device, repeats)
    flop = prefill_flop(cfg, prompts, prompt_len) / model.shard.size  # this rank's share
    tflops = flop / (ms * 1e-3) / 1e12
    return PrefillStep(prompts, prompt_len, ms, flop / 1e12, tflops, limits.of_matmul(tflops))


def fits(cfg: ModelConfig, tokens: int, dtype: str, device: str) -> bool:
    free = free_bytes(device)
    if free is None:
        return True
    elem = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    kv = tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    return kv < 0.85 * free  # leave room for activations and the graph pool


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--batches", type=_ints, default=None, help="default 1,16,64,256")
    parser.add_argument("--contexts", type=_ints, default=None, help="default 512,4096")
    parser.add_argument("--prefill-prompts", type=_ints, default=None, help="default 1,4")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--repeats", type=int, default=None, help="default 20 (quick: 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="batches 1,64,256, 1 prompt, 10 repeats"
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks (processes, one device each) the model is split over",
    )
    # A rank other than 0, started by rank 0 with the same arguments.
    parser.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tp-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Flags given win over either sweep.
    for name, values in (QUICK_SWEEP if args.quick else FULL_SWEEP).items():
        if getattr(args, name) is None:
            setattr(args, name, values)
    return args


def join_group(args: argparse.Namespace, argv: list[str]) -> TPGroup | None:
    """The ranks' group: rank 0 starts the others (this script, same arguments) and joins."""
    size = args.tensor_parallel_size
    if size == 1:
        return None
    shard = TPShard(args.tp_rank, size)
    if args.tp_rank > 0:
        return TPGroup.join(shard, args.device, port=args.tp_port)
    store = host_store(size)
    root = str(SOURCE_ROOT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    ranks = []
    for rank in range(1, size):
        extra = ["--tp-rank", str(rank), "--tp-port", str(store.port)]
        if args.device.startswith("cuda"):
            extra += ["--device", f"cuda:{rank}"]
        command = [sys.executable, "-m", "pdserve.bench.model_step", *argv, *extra]
        ranks.append(
            subprocess.Popen(_without(command, "--json"), env=env, stdout=subprocess.DEVNULL)
        )

    def check() -> None:
        dead = [r.returncode for r in ranks if r.poll() is not None]
        if dead:
            raise RuntimeError(f"a rank exited ({dead[0]}) before the group formed")

    group = TPGroup.join(shard, args.device, store=store, check_ranks=check)
    group.ranks = ranks  # waited for at the end
    return group


def _without(command: list[str], flag: str) -> list[str]:
    """The command without `flag` and its value (only rank 0 writes the JSON)."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    group = join_group(args, argv)
    shard = group.shard if group is not None else TPShard()
    if group is not None and not args.device.startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // shard.size))  # shared cores
    if shard.rank > 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (rank 0 prints the tables)
    device = args.device
    on_cuda = device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    torch_dtype = getattr(torch, dtype)
    cfg = model_config(args.preset)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    name = torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu"
    copy_bytes, matmul_n = ((2 << 30), 8192) if on_cuda else ((128 << 20), 1024)
    limits = measure_limits(device, torch_dtype, copy_bytes, matmul_n, args.repeats)
    model = random_model(cfg, dtype, device, args.seed, shard, group)
    params = sum(p.numel() for p in model.parameters())
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"# {name}; torch {torch.__version__}, python {platform.python_version()}")
    print(
        f"# copy: {limits.copy_gbps:.0f} GB/s (read + write); "
        f"{dtype} matmul: {limits.matmul_tflops:.1f} TFLOP/s"
    )
    print(
        f"# {args.preset}: {params / 1e9:.2f}B parameters on each of {shard.size} ranks "
        f"({weights_gb:.3f} GB of weights per rank), {dtype}, block {BLOCK_SIZE}, "
        f"graph block tables for {max_model_len} tokens, kernels {select_ops(device).name}"
    )
    if shard.size > 1:
        print("# GB read, GB/s and TFLOP: one rank's (its shard, its KV heads, its share)")
    print("\n## decode step (one new token per sequence)\n")
    print("| batch | context | graph ms | eager ms | GB read | GB/s | of copy |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    decode = []
    for context in args.contexts:
        for batch in args.batches:
            room = fits(cfg, batch * (context + BLOCK_SIZE), dtype, device)
            if group is not None:
                room = bool(group.min(int(room)))  # every rank runs the same steps
            if not room:
                print(f"| {batch} | {context} | KV does not fit | | | | |", flush=True)
                continue
            r = bench_decode(
                model, dtype, device, batch, context, max_model_len, limits, args.repeats
            )
            decode.append(r)
            graph = "-" if r.graph_ms is None else f"{r.graph_ms:.3f}"
            print(
                f"| {batch} | {context} | {graph} | {r.eager_ms:.3f} | {r.bytes_gb:.2f} | "
                f"{r.gbps:.0f} | {r.fraction_of_copy:.0%} |",
                flush=True,
            )
            if on_cuda:
                torch.cuda.empty_cache()
    print(f"\n## prefill step ({args.prompt_len}-token prompts)\n")
    print("| prompts | ms | TFLOP | TFLOP/s | of matmul |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    prefill = []
    for prompts in args.prefill_prompts:
        r = bench_prefill(model, dtype, device, prompts, args.prompt_len, limits, args.repeats)
        prefill.append(r)
        print(
            f"| {prompts} | {r.ms:.2f} | {r.tflop:.2f} | {r.tflops:.1f} | "
            f"{r.fraction_of_matmul:.0%} |",
            flush=True,
        )
        if on_cuda:
            torch.cuda.empty_cache()
    about = {
        "preset": args.preset,
        "dtype": dtype,
        "tensor_parallel_size": shard.size,
        "weights_gb_per_rank": weights_gb,
    }
    command = " ".join(["python -m pdserve.bench.model_step", *argv])
    results = Results(name, command, limits, decode, prefill, about).to_dict()
    if args.json and shard.rank == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if group is not None and shard.rank == 0:
        for rank in group.ranks:
            rank.wait(60)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
