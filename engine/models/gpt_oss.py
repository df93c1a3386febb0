"""gpt-oss's mixture of experts, in every layer: a router with a bias that softmaxes each token's
k largest logits, and experts whose projections carry biases around a clamped SwiGLU (the gate
clamped above, the up projection both ways, then (up + 1) * gate * sigmoid(alpha * gate)).

The op table's `fused_moe` runs the other families' gated SiLU without biases, so these experts
run in torch, each on the tokens routed to it (`kernels.moe_ref.grouped_experts`), as
transformers runs them; that groups tokens on the host, so a model with them steps eagerly (no
CUDA graphs, no compiled step). Weights keep the checkpoint's layout: `gate_up_proj[e]` is
[hidden, 2 x width] with expert e's gate and up in alternate columns (gate j at 2j, up j at
2j + 1), `down_proj[e]` [width, hidden].

A checkpoint whose experts are MXFP4 (gpt-oss's releases, `quant_method: mxfp4`) keeps them
packed in an `experts` layer (`pdserve.engine.quant.mxfp4_experts`): each routed expert's weights
are dequantized on the call, in its [out, in] layout, the biases stay float as stored.

Tensor parallelism splits every expert's intermediate columns, as `moe.SparseMoE` does: a rank
holding columns [a, b) reads the checkpoint's gate/up columns [2a, 2b) and down rows [a, b); the
router is whole on every rank, the down projection's bias is added by the first rank only, and
the layer ends in one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.engine.cpu.linear import Linear
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.moe_router import route_top_logits
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.moe_ref import grouped_experts
from pdserve.kernels.op_table import Ops


class GptOssMoE(nn.Module):
    def __init__(
        self, cfg: ModelConfig, shard: TPShard, group: TPGroup | None, layer_index: int
    ) -> None:
        super().__init__()
        self.config = cfg
        self.group = group
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.alpha = cfg.clamped_swiglu.alpha
        self.limit = cfg.clamped_swiglu.limit
        self.columns = shard.columns(cfg.moe_intermediate_size)
        width, hidden, experts = len(self.columns), cfg.hidden_size, cfg.num_experts
        self.router = Linear(hidden, experts, bias=True)
        scheme = cfg.quantization
        if scheme is not None and scheme.quantizes(f"model.layers.{layer_index}.mlp.experts"):
            self.experts = scheme.experts(experts, hidden, cfg.moe_intermediate_size, self.columns)
        else:
            self.experts = None
            self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * width))
            self.down_proj = nn.Parameter(torch.empty(experts, width, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * width))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        # The all-reduce sums every rank's partial output: one of them adds the bias.
        self.adds_down_bias = shard.is_first

    def forward(self, x: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        weights, ids = route_top_logits(self.router(x), self.top_k)
        out = grouped_experts(x, weights, ids, self.num_experts, x.shape[-1], self.expert)
        if self.group is not None:
            out = self.group.all_reduce(out)
        return out

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on the rows x routed to it (this rank's part of its output)."""
        if self.experts is None:
            gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        else:
            gate_up = F.linear(x, self.experts.gate_up(e, x.dtype), self.gate_up_proj_bias[e])
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        if self.experts is None:
            out = act @ self.down_proj[e]
        else:
            out = F.linear(act, self.experts.down(e, x.dtype))
        return out + self.down_proj_bias[e] if self.adds_down_bias else out

    # --- loading -------------------------------------------------------------------------------

    def checkpoint_names(self, prefix: str) -> list[str]:
        """This layer's MLP weights as gpt-oss's checkpoints name them."""
        p = prefix + "mlp."
        weights = ("gate_up_proj", "down_proj") if self.experts is None else self.experts.kinds
        return [p + "router.weight", p + "router.bias"] + [
            p + f"experts.{name}" for name in (*weights, "gate_up_proj_bias", "down_proj_bias")
        ]

    def load(self, part: str, tensor: CheckpointTensor) -> None:
        """Read this rank's part of one checkpoint weight (`part`: its name after `mlp.`, e.g.
        `experts.gate_up_proj`); raise naming it if misshapen."""
        if self.experts is not None and part.removeprefix("experts.") in self.experts.kinds:
            self.experts.load(part.removeprefix("experts."), tensor)
            return
        cfg = self.config
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        cols = self.columns
        pairs = range(2 * cols.start, 2 * cols.stop)  # gate and up columns, alternating
        # part: (our parameter, the checkpoint's shape, the dimension split by rank, our part)
        layout = {
            "router.weight": (self.router.weight, (experts, hidden), None, None),
            "router.bias": (self.router.bias, (experts,), None, None),
            "experts.gate_up_proj_bias": (self.gate_up_proj_bias, (experts, 2 * inter), 1, pairs),
            "experts.down_proj_bias": (self.down_proj_bias, (experts, hidden), None, None),
        }
        if self.experts is None:
            layout["experts.gate_up_proj"] = (
                self.gate_up_proj,
                (experts, hidden, 2 * inter),
                2,
                pairs,
            )
            layout["experts.down_proj"] = (self.down_proj, (experts, inter, hidden), 1, cols)
        if part not in layout:
            raise ValueError(f"unexpected weight '{tensor.name}' in checkpoint")
        param, full, dim, ours = layout[part]
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full}"
            )
        with torch.no_grad():
            param.data.copy_(tensor.read() if dim is None else tensor.read_along(dim, ours))
