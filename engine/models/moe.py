"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek: a router picks each
token's k experts, the op table's `fused_moe` runs them (the torch reference on CPU, the fused
Triton kernel on CUDA; experts kept quantized choose their own path, `QuantExperts`), and
Qwen2-MoE adds a shared expert scaled by its sigmoid gate, DeepSeek its shared experts (one MLP
n_shared_experts times an expert's width) unscaled.

Tensor parallelism splits every expert like a dense MLP: each rank holds its columns of every
expert's gate and up projections and the matching rows of its down projection, and the shared
expert alike; the router (experts x hidden, small) is whole on every rank, so each rank routes
identically without talking. The experts' and the shared expert's partial sums are added before
the layer's one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.cpu.linear import Linear, linear
from pdserve.engine.models.config import DEEPSEEK_MODEL_TYPES, ModelConfig
from pdserve.engine.models.moe_router import GroupedRouting, route, route_grouped
from pdserve.engine.quant.experts import QuantExperts
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.moe_ref import grouped_experts
from pdserve.kernels.op_table import Ops

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """Every expert's weights stacked (this rank's columns of each): `w13[e]` is expert e's gate
    projection above its up projection, `w2[e]` its down projection. On a CPU node that packs its
    linear layers (`engine.cpu.linear.pack`), each expert's two matrices are packed for oneDNN
    instead (`packed_experts`) and the stacked ones dropped."""

    def __init__(self, num_experts: int, width: int, hidden_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.width = width
        self.hidden_size = hidden_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, width))
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def run_packed(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s gated MLP on x, on its packed weights."""
        packed13, packed2 = self.packed_experts[expert]
        gate, up = linear(x, None, None, packed13).split(self.width, dim=-1)
        return linear(nn.functional.silu(gate) * up, None, None, packed2)


class SparseMoE(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        shard: TPShard,
        group: TPGroup | None,
        dense_mlp: type,
        prefix: str | None = None,
    ) -> None:
        """dense_mlp: the gated MLP class (its down projection's partial sums left unreduced
        when built without a group), for the shared expert. prefix: the checkpoint's name of
        this layer's MLP (`model.layers.3.mlp.`), where its experts may be quantized."""
        super().__init__()
        self.group = group
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.grouped = GroupedRouting.of(cfg) if cfg.model_type in DEEPSEEK_MODEL_TYPES else None
        # V3's correction bias stays float32 whatever the model's dtype (loading reads it so).
        bias = torch.zeros(cfg.num_experts) if cfg.score_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias, persistent=False)
        width = len(shard.columns(cfg.moe_intermediate_size))
        if prefix is not None and _quantized_experts(cfg, prefix):
            self.experts = cfg.quantization.experts(cfg.num_experts, width, cfg.hidden_size)
        else:
            self.experts = Experts(cfg.num_experts, width, cfg.hidden_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = len(shard.columns(cfg.shared_expert_intermediate_size))
            name = "shared_expert." if cfg.shared_expert_gated else "shared_experts."
            shared_prefix = None if prefix is None else prefix + name
            self.shared_expert = dense_mlp(cfg, shard, None, shared, prefix=shared_prefix)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.grouped is not None:
            weights, ids = route_grouped(self.gate(x), self.grouped, self.e_score_correction_bias)
        else:
            weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        experts = self.experts
        if isinstance(experts, QuantExperts):  # a fused kernel, or each routed expert dequantized
            out = experts(x, weights, ids)
        elif experts.packed_experts is not None:
            out = grouped_experts(
                x, weights, ids, experts.num_experts, experts.hidden_size, experts.run_packed
            )
        else:
            out = ops.fused_moe(x, experts.w13, experts.w2, weights, ids)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.group is not None:
            out = self.group.all_reduce(out)
        return out


def _quantized_experts(cfg: ModelConfig, prefix: str) -> bool:
    """Whether the checkpoint holds this layer's experts quantized: all of them or none (they
    are stacked into one module)."""
    scheme = cfg.quantization
    if scheme is None:
        return False
    projections = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else EXPERT_NAMES
    names = [f"{prefix}experts.{e}.{p}" for e in range(cfg.num_experts) for p in projections]
    quantized = [scheme.quantizes(name) for name in names]
    if any(quantized) and not all(quantized):
        raise ValueError(
            "config.json field 'quantization_config.modules_to_not_convert' keeps some of "
            f"{prefix}experts unquantized but not all: pdserve stacks a layer's experts"
        )
    return all(quantized)
