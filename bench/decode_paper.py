"""A decode step on paper: what one step of a dense Llama-shaped model must read, launch and
compute, and the step time each part implies at a device's measured copy bandwidth and matmul
rate. Arithmetic, not a measurement: it explains a measured step time (bench/model_step.py's
decode rows in a gpu-check results file) by parts, to say where the time beyond a copy of the
step's bytes goes.

    python -m pdserve.bench.decode_paper                       # Llama-3-8B, 256 x 512, the H200 rerun
    python -m pdserve.bench.decode_paper --batch 64 --context 4096 --preset llama3-8b

The parts follow the code a decode step runs (engine/models/llama.py through the Triton op
table): per layer a norm, the fused qkv GEMM, rotary, the KV store, the split-K decode attention
(and its reduce when it splits), o_proj, a norm, the fused gate_up GEMM, silu and the multiply
(two torch element-wise kernels), down_proj; then the final norm and the LM head. The split plan
is the kernel's own (`plan_decode_splits`, planned from the block table's width as a captured
graph is). The per-launch cost is not known from first principles: it is inferred from the
batch-1 row of the same results (all weight reads, nearly no KV), where the time beyond the
bytes at the copy rate is taken as launch gaps and kernel tails.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench.model_step import BLOCK_SIZE, model_config
from pdserve.engine.models.config import ModelConfig
from pdserve.kernels.triton_attention import (
    DEFAULT_SM_COUNT,
    decode_config,
    plan_decode_splits,
)

DEFAULT_RESULTS = Path(__file__).parent / "results" / "gpu_check_h200_rerun.json"
LOGIT_BYTES = 4  # compute_logits returns float32 logits

# The kernels one decoder layer launches in a decode step, in order (the Triton op table on CUDA;
# GEMMs through cuBLAS, one launch each).
LAYER_KERNELS = (
    "add_rms_norm",
    "qkv_proj",
    "apply_rotary",
    "store_kv",
    "decode_attention",
    "o_proj",
    "add_rms_norm",
    "gate_up_proj",
    "silu",
    "mul",
    "down_proj",
)
REDUCE_KERNEL = "decode_reduce"
STEP_KERNELS = ("embedding", "final_norm", "lm_head")


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """The decode attention's launch grid at one batch: splits per (sequence, KV head), tokens
    per split, programs per SM and the float32 partial sums the reduce kernel reads back."""

    splits: int
    partition: int
    programs: int
    programs_per_sm: float
    partial_bytes: int  # written by the split kernel and read by the reduce, all layers


@dataclass(frozen=True, slots=True)
class Part:
    """One part of the step: bytes it moves (read + written), FLOPs, kernel launches."""

    name: str
    bytes: int
    flop: int = 0
    launches: int = 0


def split_plan(
    cfg: ModelConfig, batch: int, table_tokens: int, dtype: torch.dtype, sm_count: int
) -> SplitPlan:
    """The kernel's own plan for a graph whose block tables cover `table_tokens` tokens."""
    block_n = decode_config(cfg.head_dim, dtype).block_n
    max_context = math.ceil(table_tokens / BLOCK_SIZE) * BLOCK_SIZE
    splits, partition = plan_decode_splits(
        batch * cfg.num_kv_heads, 1, max_context, block_n, sm_count
    )
    programs = batch * cfg.num_kv_heads * splits
    partials = 0
    if splits > 1:
        # [B, H, S, head_dim] outputs and [B, H, S] log-sum-exps, written then read.
        per_layer = batch * cfg.num_heads * splits * (cfg.head_dim + 1) * 4
        partials = 2 * per_layer * cfg.num_layers
    return SplitPlan(splits, partition, programs, programs / sm_count, partials)


def linear_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of one layer's four projections, the LM head's)."""
    q, kv, h, i = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h
    return layer, cfg.vocab_size * h


def step_parts(
    cfg: ModelConfig, batch: int, context: int, elem: int, plan: SplitPlan
) -> list[Part]:
    """The step's parts for `batch` sequences of `context` tokens each plus the new one."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, i, layers = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.num_layers
    layer_params, head_params = linear_params(cfg)
    norms = (2 * layers + 1) * h
    weights = (layers * layer_params + head_params + norms + batch * h) * elem
    tokens = context + 1
    kv_read = batch * tokens * layers * 2 * kv * elem
    kv_write = batch * layers * 2 * kv * elem
    # Activations each kernel reads and writes, per token per layer (elements).
    per_token = (
        2 * (2 * h)  # two add+norms: read hidden and residual, write normed and residual
        + (q + 2 * kv)  # qkv GEMM writes
        + 2 * (q + kv)  # rotary reads and writes q and k
        + 2 * kv  # the KV store reads k and v
        + 2 * q  # attention reads q, writes its output
        + q
        + h  # o_proj reads, writes
        + 2 * i  # gate_up writes
        + 2 * i  # silu reads gate, writes
        + 3 * i  # mul reads two, writes one
        + i
        + h  # down_proj reads, writes
    )
    activations = batch * (layers * per_token + 2 * h) * elem + batch * cfg.vocab_size * LOGIT_BYTES
    group = cfg.num_heads // cfg.num_kv_heads
    padded_group = max(16, 1 << (group - 1).bit_length())  # the kernel's BLOCK_G
    attention_flop = (
        2 * 2 * batch * layers * cfg.num_kv_heads * padded_group * cfg.head_dim * tokens
    )
    per_layer_launches = len(LAYER_KERNELS) + (plan.splits > 1)
    return [
        Part(
            "weights (GEMMs, norms, embedding rows)",
            weights,
            2 * batch * (layers * layer_params + head_params),
            4 * layers + 1,
        ),
        Part("KV pages read", kv_read, attention_flop, layers),
        Part("KV store", kv_write, 0, layers),
        Part("activations and logits", activations, 0, 5 * layers + 2),
        Part("split-K partials", plan.partial_bytes, 0, (per_layer_launches - 11) * layers),
    ]


def model_step_bytes(parts: list[Part]) -> int:
    """The bytes bench/model_step.py divides by the step time: the weights and the KV read."""
    return parts[0].bytes + parts[1].bytes


def recorded_kernel_ms(results: dict, batch: int, context: int) -> float | None:
    """The decode attention kernel alone at this case with its default tiles (the tiles step of
    the same gpu-check run), ms per layer; None where the run did not time it."""
    for step in results["steps"]:
        if step["name"] == "tiles" and step.get("data"):
            for row in step["data"].get("decode", []):
                if row["case"] == [batch, context] and row["default"]:
                    return row["ms"]
    return None


def step_launches(cfg: ModelConfig, plan: SplitPlan) -> int:
    """Kernels one decode step launches (the CUDA graph replays them all)."""
    return cfg.num_layers * (len(LAYER_KERNELS) + (plan.splits > 1)) + len(STEP_KERNELS)


def recorded(results: dict) -> dict:
    """The model_step step of a gpu-check run's results: copy GB/s, matmul TFLOP/s, decode rows."""
    step = next(s for s in results["steps"] if s["name"] == "model_step")
    return step["data"]


def launch_cost_s(cfg: ModelConfig, data: dict, elem: int, sm_count: int) -> float:
    """Seconds a launch costs beyond its bytes, from the recorded batch-1 row at the shortest
    context: (graph time - bytes at the copy rate) / launches."""
    row = min((r for r in data["decode"] if r["batch"] == 1), key=lambda r: r["context"])
    table = cfg.max_position_embeddings
    plan = split_plan(cfg, 1, table, torch.bfloat16, sm_count)
    moved = sum(p.bytes for p in step_parts(cfg, 1, row["context"], elem, plan))
    return (row["graph_ms"] * 1e-3 - moved / (data["copy_gbps"] * 1e9)) / step_launches(cfg, plan)


def parts_table(parts: list[Part], copy: float, matmul: float) -> str:
    """The parts as a markdown table: bytes, share, time at the copy and matmul rates, launches."""
    total = sum(p.bytes for p in parts)
    lines = [
        "| part | GB moved | share | ms at copy | ms at matmul | launches |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in parts:
        at_copy, at_matmul = p.bytes / copy * 1e3, p.flop / matmul * 1e3
        lines.append(
            f"| {p.name} | {p.bytes / 1e9:.3f} | {p.bytes / total:.1%} | {at_copy:.3f} | "
            f"{at_matmul:.3f} | {p.launches} |"
        )
    return "\n".join(lines)


def docs_table(
    results: dict, preset: str = "llama3-8b", batch: str = "256", context: str = "512"
) -> str:
    """The parts table of a gpu-check run's results for the docs (`python -m pdserve.bench.docs`)."""
    cfg, data = model_config(preset), recorded(results)
    plan = split_plan(
        cfg, int(batch), cfg.max_position_embeddings, torch.bfloat16, DEFAULT_SM_COUNT
    )
    parts = step_parts(cfg, int(batch), int(context), 2, plan)
    return parts_table(parts, data["copy_gbps"] * 1e9, data["matmul_tflops"] * 1e12)


def report(preset: str, batch: int, context: int, results: Path, sm_count: int) -> str:
    cfg = model_config(preset)
    elem = 2
    raw = json.loads(results.read_text())
    data = recorded(raw)
    copy, matmul = data["copy_gbps"] * 1e9, data["matmul_tflops"] * 1e12
    plan = split_plan(cfg, batch, cfg.max_position_embeddings, torch.bfloat16, sm_count)
    parts = step_parts(cfg, batch, context, elem, plan)
    launches = step_launches(cfg, plan)
    gap = launch_cost_s(cfg, data, elem, sm_count)
    total = sum(p.bytes for p in parts)
    bound = sum(max(p.bytes / copy, p.flop / matmul) for p in parts) * 1e3
    lines = [
        f"{preset}, batch {batch} x context {context}, bfloat16, blocks of {BLOCK_SIZE}; "
        f"copy {data['copy_gbps']:.0f} GB/s, matmul {data['matmul_tflops']:.0f} TFLOP/s "
        f"({results.name}); arithmetic, not a measurement",
        "",
        parts_table(parts, copy, matmul),
    ]
    launch_ms = launches * gap * 1e3
    measured = next(
        (r for r in data["decode"] if r["batch"] == batch and r["context"] == context), None
    )
    lines += [
        "",
        f"split plan (table {cfg.max_position_embeddings} tokens): {plan.splits} split(s) of "
        f"{plan.partition} tokens, {plan.programs} programs, {plan.programs_per_sm:.1f} per SM "
        f"of {sm_count}; partials {plan.partial_bytes / 1e6:.1f} MB",
        f"launches per step: {launches}; cost per launch inferred from batch 1: {gap * 1e6:.2f} us "
        f"-> {launch_ms:.3f} ms",
        f"all bytes at copy: {total / copy * 1e3:.3f} ms; each part at its slower limit: "
        f"{bound:.3f} ms; plus launches: {bound + launch_ms:.3f} ms",
    ]
    counted = model_step_bytes(parts)
    lines.append(
        f"model_step's bytes (weights + KV read) {counted / 1e9:.3f} GB: at the parts' limits "
        f"{counted / copy / (bound * 1e-3):.0%} of copy, with launches "
        f"{counted / copy / ((bound + launch_ms) * 1e-3):.0%}; 75% needs a step of "
        f"{counted / copy / 0.75 * 1e3:.3f} ms"
    )
    kernel_ms = recorded_kernel_ms(raw, batch, context)
    if kernel_ms is not None:
        at_copy = parts[1].bytes / copy * 1e3
        lines.append(
            f"recorded decode attention alone (tiles step): {kernel_ms:.4f} ms a layer, "
            f"{kernel_ms * cfg.num_layers:.3f} ms a step against {at_copy:.3f} ms at copy "
            f"(+{kernel_ms * cfg.num_layers - at_copy:.3f} ms)"
        )
    if measured:
        ms = measured["graph_ms"]
        lines.append(
            f"measured graph step: {ms:.3f} ms ({measured['fraction_of_copy']:.0%} of copy); "
            f"beyond the parts' limits and launches: {ms - bound - launch_ms:.3f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--sm-count", type=int, default=DEFAULT_SM_COUNT)
    args = parser.parse_args(argv)
    text = report(args.preset, args.batch, args.context, args.results, args.sm_count)
    print(text)
    return text


if __name__ == "__main__":
    main()
