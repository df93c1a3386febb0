"""What Llama 4's text model adds to Llama's decoder: what its attention does to q and k
(`Llama4QK`) and its mixture of experts (`Llama4MoE`).

Attention: rotary only on the layers the config marks (the others are NoPE), its pairs
interleaved, (2i, 2i + 1), as transformers rotates them as complex numbers; the op table's
`apply_rotary` pairs (i, i + d/2), so these layers rotate here, in torch, from the model's cos/sin
table (elementwise ops without a host sync, so a CUDA graph keeps them). Then an L2 norm of each
head of q and k on the rotary layers (`use_qk_norm`), and on the NoPE layers q scaled by a
temperature growing with the position (`attn_temperature_tuning`).

Experts: a sparse layer's router takes each token's k largest logits, and their sigmoids scale
the token before it enters those experts (the scale cannot move past the SiLU); the experts'
outputs are summed unweighted, in expert order as transformers sums them, and a shared expert (a
dense MLP as wide as one expert) is added. transformers saves the experts fused,
`experts.gate_up_proj` [experts, hidden, 2 x width] (gate columns, then up columns) and
`experts.down_proj` [experts, width, hidden]; loading transposes them into `moe.Experts`' stacked
layout, so they run through the op table's `fused_moe` (each routed (token, expert) pair a row of
its own, of weight one) and pack for oneDNN on CPU nodes like every family's. Tensor parallelism
splits every expert's and the shared expert's columns as `moe.SparseMoE` does; the router is
whole on every rank; the layer ends in one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.cpu.linear import Linear
from pdserve.engine.models.config import Llama4Attention, ModelConfig
from pdserve.engine.models.moe import Experts
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.moe_ref import grouped_experts
from pdserve.kernels.op_table import Ops


class Llama4QK:
    """One layer's treatment of its queries and keys, between projection and attention."""

    def __init__(self, attention: Llama4Attention, layer_index: int, eps: float) -> None:
        self.rotary = attention.rope_layers[layer_index]
        self.l2_norm = self.rotary and attention.qk_l2_norm  # transformers': rotary layers only
        self.temperature = not self.rotary and attention.temperature_tuning
        self.eps = eps
        self.floor_scale = attention.floor_scale
        self.attn_scale = attention.attn_scale

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D], positions [T], cos_sin [max_pos, D] (cos | sin halves)."""
        if self.rotary:
            table = cos_sin[positions]
            q, k = rotate_pairs(q, table), rotate_pairs(k, table)
        if self.l2_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature:
            floors = torch.floor((positions.float() + 1.0) / self.floor_scale)
            scales = torch.log1p(floors) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k


def rotate_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated pair by pair, each (x[2i], x[2i + 1]) as the complex number
    x[2i] + i x[2i + 1] times cos + i sin of its frequency; table [T, D]: cos | sin halves."""
    half = table.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    pairs = x.float().unflatten(-1, (half, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head scaled to unit root mean square (RMSNorm without a weight), in float32."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4MoE(nn.Module):
    def __init__(
        self, cfg: ModelConfig, shard: TPShard, group: TPGroup | None, dense_mlp: type
    ) -> None:
        """dense_mlp: the gated MLP class (its down projection's partial sums left unreduced
        when built without a group), for the shared expert."""
        super().__init__()
        self.config = cfg
        self.group = group
        self.top_k = cfg.num_experts_per_tok
        self.columns = shard.columns(cfg.moe_intermediate_size)
        self.shared_columns = shard.columns(cfg.shared_expert_intermediate_size)
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, len(self.columns), cfg.hidden_size)
        self.shared_expert = dense_mlp(cfg, shard, None, len(self.shared_columns))

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)
        ids, order = ids.sort(dim=-1)  # transformers sums the experts' outputs in expert order
        scores = scores.gather(1, order)
        hidden = x.shape[-1]
        # One row per routed (token, expert) pair: the token scaled by that expert's score.
        rows = (x[:, None, :] * scores[..., None]).reshape(-1, hidden)
        row_ids = ids.reshape(-1, 1)
        ones = torch.ones(row_ids.shape, dtype=torch.float32, device=x.device)
        experts = self.experts
        if experts.packed_experts is not None:
            routed = grouped_experts(
                rows, ones, row_ids, experts.num_experts, hidden, experts.run_packed
            )
        else:
            routed = ops.fused_moe(rows, experts.w13, experts.w2, ones, row_ids)
        out = routed.view(-1, self.top_k, hidden).sum(dim=1) + self.shared_expert(x)
        if self.group is not None:
            out = self.group.all_reduce(out)
        return out

    # --- loading -------------------------------------------------------------------------------

    def checkpoint_names(self, prefix: str) -> list[str]:
        """This layer's feed-forward weights as Llama 4's checkpoints name them."""
        p = prefix + "feed_forward."
        return [p + "router.weight", p + "experts.gate_up_proj", p + "experts.down_proj"] + [
            p + f"shared_expert.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")
        ]

    def load(self, part: str, tensor: CheckpointTensor) -> None:
        """Read this rank's part of one checkpoint weight (`part`: its name after
        `feed_forward.`, e.g. `experts.gate_up_proj`); raise naming it if misshapen."""
        cfg = self.config
        experts, hidden = cfg.num_experts, cfg.hidden_size
        width, shared_width = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes = {
            "router.weight": (experts, hidden),
            "experts.gate_up_proj": (experts, hidden, 2 * width),
            "experts.down_proj": (experts, width, hidden),
            "shared_expert.gate_proj.weight": (shared_width, hidden),
            "shared_expert.up_proj.weight": (shared_width, hidden),
            "shared_expert.down_proj.weight": (hidden, shared_width),
        }
        if part not in shapes:
            raise ValueError(f"unexpected weight '{tensor.name}' in checkpoint")
        if tuple(tensor.shape) != shapes[part]:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {shapes[part]}"
            )
        cols, shared = self.columns, self.shared_columns
        mlp = self.shared_expert
        with torch.no_grad():
            if part == "router.weight":
                self.router.weight.data.copy_(tensor.read())
            elif part == "experts.gate_up_proj":  # [E, H, 2I] -> w13 [E, our gate; our up, H]
                w13 = self.experts.w13.data
                up = range(width + cols.start, width + cols.stop)
                w13[:, : len(cols)].copy_(tensor.read_along(2, cols).transpose(1, 2))
                w13[:, len(cols) :].copy_(tensor.read_along(2, up).transpose(1, 2))
            elif part == "experts.down_proj":  # [E, I, H] -> w2 [E, H, our I]
                self.experts.w2.data.copy_(tensor.read_along(1, cols).transpose(1, 2))
            elif part == "shared_expert.down_proj.weight":
                mlp.down_proj.weight.data.copy_(tensor.read(columns=shared))
            else:  # the shared expert's gate rows, then its up rows, in its fused gate_up_proj
                offset = 0 if part == "shared_expert.gate_proj.weight" else len(shared)
                rows = mlp.gate_up_proj.weight.data.narrow(0, offset, len(shared))
                rows.copy_(tensor.read(rows=shared))
