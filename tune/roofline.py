"""Profiles for GPUs not at hand: a roofline of the model's FLOPs and bytes against a device's stated
peaks times stated efficiencies, or against the rates a device reached in `pdserve.bench.model_step`.
Every figure that is assumed rather than measured is named in the profile's `source`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.tune.model_shape import DTYPE_BYTES, ModelShape
from pdserve.tune.profile import GroupModel, Profile
from pdserve.tune.step_model import StepTimeModel
from pdserve.tune.transfer_model import TransferModel


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    tflops: float  # dense bf16 peak, TFLOP/s, as the vendor states it
    gbps: float  # memory bandwidth peak, GB/s
    memory_gb: float
    link: str = ""  # what joins the GPUs of one host
    link_gbps: float = 0.0  # per GPU, each direction, as stated


# NVIDIA's datasheet figures (dense, no sparsity; NVLink's total halved for one direction).
DEVICES = {
    "h100": Device("NVIDIA H100 SXM5 80GB", 989.0, 3350.0, 80.0, "NVLink 4", 450.0),
    "h200": Device("NVIDIA H200 SXM 141GB", 989.0, 4800.0, 141.0, "NVLink 4", 450.0),
    "a100": Device("NVIDIA A100 SXM4 80GB", 312.0, 2039.0, 80.0, "NVLink 3", 300.0),
    "l40s": Device("NVIDIA L40S 48GB", 362.0, 864.0, 48.0, "PCIe 4.0 x16", 32.0),
}

TP_SIZES = (1, 2, 4, 8)  # the groups a roofline profile models, of those that fit


@dataclass(frozen=True, slots=True)
class Assumptions:
    """What a roofline takes as given; each shows in the profile's source line."""

    compute_efficiency: float = 0.6  # of peak FLOP/s reached by a step's matmuls and attention
    memory_efficiency: float = 0.75  # of peak bandwidth reached by weight and KV reads
    step_overhead_s: float = 0.0005  # per step: launches (graphs), scheduling, sampling
    per_seq_s: float = 5e-6  # per sequence in a step: the host's bookkeeping
    memory_utilization: float = 0.9  # of device memory given to weights, activations and KV
    activation_reserve_gb: float = 4.0  # per device, out of the KV pool
    transfer_gbps: float = 50.0  # per GPU's KV sends (400 Gb/s InfiniBand per GPU)
    transfer_latency_s: float = 0.0005
    transport: str = "nccl"
    allreduce_efficiency: float = 0.7  # of the link's stated bandwidth an all-reduce reaches
    allreduce_latency_s: float = 10e-6  # per all-reduce, whatever its size

    def describe(self) -> str:
        return (
            f"{self.compute_efficiency:.0%} of peak FLOP/s, {self.memory_efficiency:.0%} of peak "
            f"bandwidth, {self.step_overhead_s * 1e3:g} ms + {self.per_seq_s * 1e6:g} us per "
            f"sequence of overhead a step; KV at {self.transfer_gbps:g} GB/s a GPU + "
            f"{self.transfer_latency_s * 1e3:g} ms a transfer"
        )

    def describe_allreduce(self, d: Device) -> str:
        return (
            f"a node of G GPUs splits weights, KV and FLOPs over G and adds two all-reduces a "
            f"layer of the step's tokens x hidden x dtype bytes, ring (2(G-1)/G of the bytes "
            f"each way) over {d.link} at {d.link_gbps:g} GB/s a direction (stated) x "
            f"{self.allreduce_efficiency:.0%}, + {self.allreduce_latency_s * 1e6:g} us each "
            "(assumed); the LM head's gather not counted"
        )


def allreduce_seconds(
    model: ModelShape, dtype: str, gpus: int, tokens: int, d: Device, a: Assumptions
) -> float:
    """The all-reduces of one step of `tokens` new tokens on a tensor-parallel group of `gpus`:
    two a layer (after attention, after the MLP), each of tokens x hidden values, by a ring."""
    if gpus == 1:
        return 0.0
    message = tokens * model.hidden_size * DTYPE_BYTES[dtype]
    wire = 2 * (gpus - 1) / gpus * message / (d.link_gbps * 1e9 * a.allreduce_efficiency)
    return 2 * model.num_layers * (a.allreduce_latency_s + wire)


def roofline_step(
    model: ModelShape,
    dtype: str,
    tflops: float,
    gbps: float,
    overhead_s: float,
    per_seq_s: float,
    gpus: int = 1,
) -> StepTimeModel:
    """A step's time as the larger of its FLOPs over `tflops` and its bytes over `gbps` (the rates
    reached, not the peaks, of all `gpus` of a tensor-parallel group together), plus overheads.
    The group splits the work but for what every rank holds whole, which each one reads and
    computes: MLA's latent KV and down-projections, KV heads that ranks share, the router."""
    flop_s, byte_s = 1.0 / (tflops * 1e12), 1.0 / (gbps * 1e9)
    replicated = model.replicated_params(gpus)
    # A context token costs the KV of the full-attention layers; a windowed or chunked layer
    # reads at most its reach a sequence, counted whole with each sequence of the step.
    window_s = model.kv_window_bytes(dtype) * model.kv_replicas(gpus) * byte_s
    return StepTimeModel(
        base_s=overhead_s,
        per_seq_s=per_seq_s + window_s,
        per_token_s=(model.flops_per_token + 2.0 * replicated) * flop_s,
        per_pair_s=model.flops_per_attention_pair * flop_s,
        per_row_s=model.flops_per_logits_row * flop_s,
        per_context_s=model.kv_bytes_per_token(dtype) * model.kv_replicas(gpus) * byte_s,
        weights_s=(model.step_weight_bytes(dtype) + model.replicated_bytes(gpus, dtype)) * byte_s,
        overlap=True,
        expert_weights_s=model.expert_weight_bytes(dtype) * byte_s,
        num_experts=model.num_experts,
        experts_per_token=model.experts_per_token,
    )


def kv_blocks(
    model: ModelShape, dtype: str, block_size: int, memory_gb: float, a: Assumptions, gpus: int
) -> int:
    """A node's KV pool: what its GPUs' memory holds beyond the weights (split over them, but for
    what every rank holds whole) and the activations; 0 or less where nothing is left. A block
    costs its KV once per copy the group keeps: MLA's latent is on every GPU, so its pool does
    not grow with the group's size beyond the room the split weights leave."""
    budget = gpus * (memory_gb * a.memory_utilization - a.activation_reserve_gb) * 1e9
    weights = model.weight_bytes(dtype) + model.replicated_bytes(gpus, dtype)
    per_block = model.kv_bytes_per_block(block_size, dtype) * model.kv_replicas(gpus)
    return int((budget - weights) // per_block)


def group_model(
    model: ModelShape, d: Device, gpus: int, dtype: str, block_size: int, a: Assumptions
) -> GroupModel:
    """A node of `gpus` GPUs of device `d` as a tensor-parallel group: G times the peaks and the
    memory, plus its all-reduces."""
    step = roofline_step(
        model,
        dtype,
        gpus * d.tflops * a.compute_efficiency,
        gpus * d.gbps * a.memory_efficiency,
        a.step_overhead_s,
        a.per_seq_s,
        gpus,
    )
    allreduce_latency = allreduce_seconds(model, dtype, gpus, 0, d, a)
    per_token = allreduce_seconds(model, dtype, gpus, 1, d, a) - allreduce_latency
    step = replace(step, base_s=step.base_s + allreduce_latency, allreduce_per_token_s=per_token)
    # Each rank sends its own heads' pages; ranks that share a head send a whole copy of it each
    # (to their peers), so a group sends one copy of the KV at the rate of its distinct shards.
    shards = gpus // model.kv_replicas(gpus)
    return GroupModel(
        gpus,
        step,
        TransferModel(a.transfer_latency_s, shards * a.transfer_gbps * 1e9, a.transport),
        kv_blocks(model, dtype, block_size, d.memory_gb, a, gpus),
    )


def roofline_profile(
    model: ModelShape,
    device: str,
    *,
    tp_sizes: Sequence[int] = TP_SIZES,
    dtype: str = "bfloat16",
    block_size: int = 16,
    assumptions: Assumptions | None = None,
) -> Profile:
    """The roofline of `device` (a key of DEVICES) for nodes of each of `tp_sizes` GPUs that
    hold the model with room for KV (one sequence of its whole context, at least): a node of G
    GPUs is a tensor-parallel group, G times the peaks and memory, plus its all-reduces."""
    a = assumptions or Assumptions()
    d = DEVICES[device]
    groups, left_out = [], []
    for g in sorted(set(tp_sizes)):
        group = group_model(model, d, g, dtype, block_size, a)
        if group.kv_blocks >= model.kv_blocks_held(model.max_position_embeddings, block_size):
            groups.append(group)
        else:
            left_out.append(g)
    if not groups:
        raise ValueError(
            f"{model.name} ({model.weight_bytes(dtype) / 1e9:.0f} GB of "
            f"{model.weights_label(dtype)} weights) leaves "
            f"no room for KV on {max(tp_sizes)} x {d.memory_gb:g} GB: give larger "
            "--tensor-parallel-sizes"
        )
    sizes = [g.size for g in groups]
    source = (
        f"roofline, not measured: {d.name} at {d.tflops:g} TFLOP/s and {d.gbps:g} GB/s "
        f"stated peaks, {a.describe()}"
    )
    if sizes != [1]:
        source += f"; nodes of {', '.join(map(str, sizes))} GPUs"
        if left_out:
            source += f" ({', '.join(map(str, left_out))}: no room for KV)"
        if max(sizes) > 1:
            source += "; " + a.describe_allreduce(d)
            if model.is_mla:
                source += (
                    "; MLA's latent KV and down-projections are not split: every GPU "
                    "stores, reads and sends its own copy"
                )
    base, rest = groups[0], tuple(groups[1:])
    return Profile(
        model=model,
        dtype=dtype,
        step=base.step,
        transfer=base.transfer,
        kv_blocks=base.kv_blocks,
        block_size=block_size,
        source=source,
        device=d.name,
        devices_per_node=base.size,
        groups=rest,
    )


def model_step_profile(
    path: str | Path,
    model: ModelShape,
    *,
    memory_gb: float | None = None,
    block_size: int = 16,
    assumptions: Assumptions | None = None,
) -> Profile:
    """The roofline at the rates a device reached in `pdserve.bench.model_step --json`: its best decode
    bandwidth (bytes a step must read over the step's time) and its best prefill FLOP/s, with the
    smallest decode step's excess over its bytes as the per-step overhead."""
    a = assumptions or Assumptions()
    data = json.loads(Path(path).read_text())
    dtype = data.get("dtype", "bfloat16")
    decode, prefill = data.get("decode") or [], data.get("prefill") or []
    if not decode or not prefill:
        raise ValueError(f"{path}: needs decode and prefill results of bench.model_step --json")
    gbps = max(r["gbps"] for r in decode)
    tflops = max(r["tflops"] for r in prefill)

    def ms(r: dict) -> float:
        return min(t for t in (r.get("graph_ms"), r["eager_ms"]) if t is not None)

    smallest = min(decode, key=lambda r: (r["batch"], r["context"]))
    overhead = max(0.0, (ms(smallest) - smallest["bytes_gb"] / gbps * 1e3) * 1e-3)
    step = roofline_step(model, dtype, tflops, gbps, overhead, a.per_seq_s)
    device = data.get("device", "unknown device")
    if memory_gb is None:
        raise ValueError("a profile from bench.model_step needs the device's memory (--memory-gb)")
    return Profile(
        model=model,
        dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
        step=step,
        transfer=TransferModel(a.transfer_latency_s, a.transfer_gbps * 1e9, a.transport),
        kv_blocks=_fits(kv_blocks(model, dtype, block_size, memory_gb, a, 1), model, dtype),
        block_size=block_size,
        source=(
            f"from bench.model_step on {device} ({data.get('preset')}, {dtype}): "
            f"{gbps:.0f} GB/s decode, {tflops:.0f} TFLOP/s prefill, {overhead * 1e3:.2f} ms "
            f"overhead a step, as reached; KV at {a.transfer_gbps:g} GB/s + "
            f"{a.transfer_latency_s * 1e3:g} ms a transfer (assumed)"
        ),
        device=device,
    )


def _fits(blocks: int, model: ModelShape, dtype: str) -> int:
    if blocks < 1:
        raise ValueError(
            f"{model.name} ({model.weight_bytes(dtype) / 1e9:.0f} GB of "
            f"{model.weights_label(dtype)} weights) leaves "
            "no room for KV on one GPU"
        )
    return blocks
