"""Qwen3-Next and Qwen3.5 (dense and MoE; a multimodal checkpoint's language model): layers of
Gated DeltaNet (linear attention, its state kept in the paged pool as `LinearState` pages) between
full-attention layers with an output gate, zero-centred RMSNorms and partial rotary, over Llama's
step loop, MLP and experts.

A linear layer's state after position p lives in the page of the block holding p (of its KV
group's table), so a step reads each sequence's state from the block of the token before its
first, runs its tokens in segments that end at block boundaries and writes each segment's final
state into the block of its last token: every block left behind holds the state at its end."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.engine.cpu.linear import Linear
from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.kv.groups import groups_for
from pdserve.engine.kv.state_pages import LinearStateShape
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from pdserve.engine.models.moe import SparseMoE
from pdserve.engine.models.norm import RMSNorm
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.parallel_layers import RowParallelLinear
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.gated_delta_ref import (
    causal_conv,
    causal_conv_step,
    chunked_gated_delta_rule,
)
from pdserve.kernels.op_table import Ops

# A linear layer's weight, read by its GatedDeltaNet: the layer, the name within it.
LINEAR_WEIGHT = re.compile(r"layers\.(\d+)\.linear_attn\.(.+)")
# Stacked experts as Qwen3.5-MoE's releases save them ([experts, 2 x width, hidden] gate above
# up, and [experts, hidden, width]): the layer and which.
STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
# A multimodal checkpoint's language model under the text model's names; what is not loaded:
# the vision tower and the multi-token-prediction layers (a draft's, not the model's).
TEXT_PREFIX = ("model.language_model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


class GatedAttention(Attention):
    """Llama's paged attention, q_proj giving each head's query and then its output gate
    (sigmoid(gate) scales the head's output before o_proj), q and k RMS-normed, rotary turning
    each head's first `rope_dim` dimensions."""

    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        super().__init__(cfg, layer_index, shard, group)
        # This rank's heads' (query, gate) pairs, then its keys and values.
        self.qkv_proj = Linear(
            cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.rotary_dim = cfg.rope_dim

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(-1, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate.split(self.head_dim, dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = ops.rms_norm(q.contiguous(), self.q_norm.weight, self.q_norm.eps)
        k = ops.rms_norm(k.contiguous(), self.k_norm.weight, self.k_norm.eps)
        rot = self.rotary_dim
        if rot == self.head_dim:
            q, k = ops.apply_rotary(q, k, positions, cos_sin)
        else:
            q_rot, k_rot = ops.apply_rotary(q[..., :rot], k[..., :rot], positions, cos_sin)
            q = torch.cat([q_rot, q[..., rot:]], dim=-1)
            k = torch.cat([k_rot, k[..., rot:]], dim=-1)
        out = self.paged(q, k, v, batch, pool, ops).reshape(-1, self.q_size) * torch.sigmoid(
            gate.reshape(-1, self.q_size)
        )
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer: q, k and v through a short causal convolution, the gated delta
    rule per value head (`gated_delta`), its output RMS-normed per head and gated by
    silu(z), then out_proj. This rank's key and value heads are a contiguous share of each."""

    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        super().__init__()
        linear = cfg.linear_attention
        self.layer_index = layer_index
        self.kv_group = groups_for(cfg.num_layers, cfg.layer_kinds).group_of[layer_index]
        self.model_type = cfg.model_type
        self.hidden_size = cfg.hidden_size
        self.all_k_heads, self.all_v_heads = linear.num_k_heads, linear.num_v_heads
        self.k_heads = shard.columns(linear.num_k_heads)
        self.v_heads = shard.columns(linear.num_v_heads)
        self.num_k_heads, self.num_v_heads = len(self.k_heads), len(self.v_heads)
        self.head_k_dim, self.head_v_dim = linear.head_k_dim, linear.head_v_dim
        self.kernel = linear.conv_kernel
        self.key_size = self.num_k_heads * self.head_k_dim
        self.value_size = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        # q, k, v (the convolution's channels), z, b and a of this rank's heads in one matmul.
        self.in_proj = Linear(
            cfg.hidden_size, self.conv_dim + self.value_size + 2 * self.num_v_heads, bias=False
        )
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        # The gated norm's weight multiplies as it is (not 1 + weight as the model's RMSNorms).
        self.norm_weight = nn.Parameter(torch.empty(self.head_v_dim))
        self.eps = cfg.rms_norm_eps
        self.out_proj = RowParallelLinear(self.value_size, cfg.hidden_size, False, group)
        self.state = LinearStateShape(
            pool_heads=len(shard.kv_heads(cfg.num_kv_heads)),
            head_dim=cfg.head_dim,
            planes=cfg.cache_planes,
            num_k_heads=self.num_k_heads,
            num_v_heads=self.num_v_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            conv_kernel=self.kernel,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        planes = pool.layer(self.layer_index)
        block_size = planes[0].shape[1]
        if block_size < self.state.min_block_size():
            raise ValueError(
                f"a block of {block_size} tokens cannot hold layer {self.layer_index}'s linear "
                f"attention state: it needs blocks of at least {self.state.min_block_size()}"
            )
        _, tables = batch.group(self.kv_group)
        mixed, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads], dim=-1
        )
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        seq_lens = batch.seq_lens.tolist()
        starts = batch.query_start_loc.tolist()
        core = torch.empty(hidden.shape[0], self.num_v_heads, self.head_v_dim, device=hidden.device)
        single = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        several = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] > 1]
        writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if single:
            writes.append(
                self._step(single, seq_lens, starts, mixed, g, beta, core, tables, planes, ops)
            )
        for i in several:
            writes += self._segments(i, seq_lens, starts, mixed, g, beta, core, tables, planes)
        blocks, conv, recurrent = (torch.cat(parts) for parts in zip(*writes))
        self.state.write(planes, blocks, conv, recurrent)
        return self.out_proj(self._gated_norm(core.to(hidden.dtype), z))

    @staticmethod
    def _state_blocks(
        tables: torch.Tensor, seqs: torch.Tensor, starts: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """The blocks holding these sequences' states before their first tokens (at starts):
        the blocks of position start - 1 (block 0 where a sequence starts at 0, read as zeros)."""
        return tables[seqs, (starts - 1).clamp(min=0) // block_size].long()

    def _read(
        self, planes: tuple[torch.Tensor, ...], blocks: torch.Tensor, fresh: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The states in these blocks, zeros for the sequences that start afresh."""
        conv, recurrent = self.state.read(planes, blocks)
        keep = (~fresh).to(conv.dtype)
        return conv * keep[:, None, None], recurrent.float() * keep[:, None, None, None].float()

    def _step(
        self,
        seqs: list[int],
        seq_lens: list[int],
        starts: list[int],
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        core: torch.Tensor,
        tables: torch.Tensor,
        planes: tuple[torch.Tensor, ...],
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences of one token each, together: one read of their states, one step (the
        op table's: a Triton kernel on CUDA).
        Returns (the blocks of their tokens, the states to write there)."""
        bs = planes[0].shape[1]
        device = mixed.device
        rows = torch.tensor([starts[i] for i in seqs], device=device)
        index = torch.tensor(seqs, device=device)
        position = torch.tensor([seq_lens[i] - 1 for i in seqs], device=device)
        conv, recurrent = self._read(
            planes, self._state_blocks(tables, index, position, bs), position == 0
        )
        x, conv = causal_conv_step(mixed[rows], conv, self.conv_weight)
        q, k, v = self._heads(x)
        out, recurrent = ops.gated_delta_step(q, k, v, g[rows], beta[rows], recurrent)
        core[rows] = out
        return tables[index, position // bs].long(), conv, recurrent

    def _segments(
        self,
        seq: int,
        seq_lens: list[int],
        starts: list[int],
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        core: torch.Tensor,
        tables: torch.Tensor,
        planes: tuple[torch.Tensor, ...],
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One sequence's tokens in segments ending at block boundaries, each from the state
        the previous one left. Returns the blocks of the segments' last tokens and the states
        to write there."""
        bs = planes[0].shape[1]
        device = mixed.device
        first, last = starts[seq], starts[seq + 1]
        start = seq_lens[seq] - (last - first)  # the position of its first token
        first_position = torch.tensor([start], device=device)
        previous = self._state_blocks(
            tables, torch.tensor([seq], device=device), first_position, bs
        )
        conv, recurrent = self._read(planes, previous, first_position == 0)
        conv, recurrent = conv[0], recurrent[0]
        writes = []
        position = start
        while position < seq_lens[seq]:
            end = min(seq_lens[seq], (position // bs + 1) * bs)
            rows = slice(first + position - start, first + end - start)
            x, conv = causal_conv(mixed[rows], conv, self.conv_weight)
            q, k, v = self._heads(x)
            out, recurrent = chunked_gated_delta_rule(q, k, v, g[rows], beta[rows], recurrent)
            core[rows] = out
            block = tables[seq, (end - 1) // bs].long().reshape(1)
            writes.append((block, conv[None], recurrent[None]))
            position = end
        return writes

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = x.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (
            q.reshape(-1, self.num_k_heads, self.head_k_dim),
            k.reshape(-1, self.num_k_heads, self.head_k_dim),
            v.reshape(-1, self.num_v_heads, self.head_v_dim),
        )

    def _gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head's output, times the weight, times silu(z), as
        transformers' RMSNormGated rounds it: [tokens, value heads x value dim]."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm_weight * h.to(dtype)
        h = h * F.silu(z.reshape(x.shape).float())
        return h.to(dtype).reshape(x.shape[0], -1)

    # --- loading -------------------------------------------------------------------------------

    def checkpoint_names(self, prefix: str) -> list[str]:
        """Its weights' names under a layer's prefix, as the family's checkpoints have them."""
        p = prefix + "linear_attn."
        if self.model_type == "qwen3_next":
            projections = ["in_proj_qkvz", "in_proj_ba"]
        else:
            projections = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
        names = [p + f"{name}.weight" for name in (*projections, "conv1d", "norm", "out_proj")]
        return names + [p + "dt_bias", p + "A_log"]

    def load(self, name: str, tensor: CheckpointTensor) -> None:
        """Read this rank's part of the checkpoint weight `name` (within linear_attn)."""
        dk, dv, hidden = self.head_k_dim, self.head_v_dim, self.hidden_size
        nk, nv = self.all_k_heads, self.all_v_heads
        value_rows = range(self.v_heads.start * dv, self.v_heads.stop * dv)
        heads = self.v_heads
        with torch.no_grad():
            weight = self.in_proj.weight
            if name == "in_proj_qkv.weight":
                _check(tensor, (2 * nk * dk + nv * dv, hidden))
                weight[: self.conv_dim].copy_(self._channels(tensor))
            elif name == "in_proj_z.weight":
                _check(tensor, (nv * dv, hidden))
                weight[self.conv_dim : self.conv_dim + self.value_size].copy_(
                    tensor.read(rows=value_rows)
                )
            elif name in ("in_proj_b.weight", "in_proj_a.weight"):
                _check(tensor, (nv, hidden))
                offset = self.conv_dim + self.value_size
                offset += 0 if name == "in_proj_b.weight" else self.num_v_heads
                weight[offset : offset + self.num_v_heads].copy_(tensor.read(rows=heads))
            elif name == "in_proj_qkvz.weight":
                self._load_qkvz(tensor)
            elif name == "in_proj_ba.weight":
                self._load_ba(tensor)
            elif name == "conv1d.weight":
                _check(tensor, (2 * nk * dk + nv * dv, 1, self.kernel))
                self.conv_weight.copy_(self._channels(tensor).reshape(self.conv_dim, -1))
            elif name in ("dt_bias", "A_log"):
                _check(tensor, (nv,))
                getattr(self, name).copy_(tensor.read(rows=heads))
            elif name == "norm.weight":
                _check(tensor, (dv,))
                self.norm_weight.copy_(tensor.read())
            elif name == "out_proj.weight":
                _check(tensor, (hidden, nv * dv))
                self.out_proj.weight.copy_(tensor.read(columns=value_rows))
            else:
                raise ValueError(f"unexpected weight '{tensor.name}' in checkpoint")

    def _channels(self, tensor: CheckpointTensor) -> torch.Tensor:
        """This rank's rows of a [q | k | v] tensor (in_proj_qkv, the convolution's weight):
        its key heads' query and key rows, its value heads' value rows."""
        dk, dv, key_all = self.head_k_dim, self.head_v_dim, self.all_k_heads * self.head_k_dim
        keys = range(self.k_heads.start * dk, self.k_heads.stop * dk)
        parts = [
            tensor.read(rows=keys),
            tensor.read(rows=range(key_all + keys.start, key_all + keys.stop)),
            tensor.read(
                rows=range(
                    2 * key_all + self.v_heads.start * dv, 2 * key_all + self.v_heads.stop * dv
                )
            ),
        ]
        return torch.cat(parts)

    def _load_qkvz(self, tensor: CheckpointTensor) -> None:
        """Qwen3-Next's in_proj_qkvz: per key head its q, k, then its value heads' v and z rows;
        laid out here as Qwen3.5's in_proj_qkv and in_proj_z are."""
        dk, dv, per = self.head_k_dim, self.head_v_dim, self.all_v_heads // self.all_k_heads
        group = 2 * dk + 2 * per * dv
        _check(tensor, (self.all_k_heads * group, self.hidden_size))
        rows = range(self.k_heads.start * group, self.k_heads.stop * group)
        groups = tensor.read(rows=rows).view(self.num_k_heads, group, -1)
        q, k, v, z = groups.split([dk, dk, per * dv, per * dv], dim=1)
        weight = self.in_proj.weight
        qkvz = [x.reshape(-1, self.hidden_size) for x in (q, k, v, z)]
        weight[: self.conv_dim + self.value_size].copy_(torch.cat(qkvz))

    def _load_ba(self, tensor: CheckpointTensor) -> None:
        """Qwen3-Next's in_proj_ba: per key head its value heads' b, then their a rows."""
        per = self.all_v_heads // self.all_k_heads
        _check(tensor, (self.all_k_heads * 2 * per, self.hidden_size))
        rows = range(self.k_heads.start * 2 * per, self.k_heads.stop * 2 * per)
        b, a = tensor.read(rows=rows).view(self.num_k_heads, 2 * per, -1).split(per, dim=1)
        offset = self.conv_dim + self.value_size
        ba = torch.cat([b.reshape(-1, self.hidden_size), a.reshape(-1, self.hidden_size)])
        self.in_proj.weight[offset:].copy_(ba)


def _check(tensor: CheckpointTensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {shape}"
        )


class HybridDecoderLayer(DecoderLayer):
    """Its token mixer a Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`), as
    its layer kind says; then Llama's MLP or the experts with their gated shared expert."""

    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        nn.Module.__init__(self)
        linear = bool(cfg.layer_kinds) and cfg.layer_kinds[layer_index] == "linear"
        self.linear_attn = GatedDeltaNet(cfg, layer_index, shard, group) if linear else None
        self.self_attn = None if linear else GatedAttention(cfg, layer_index, shard, group)
        if cfg.is_sparse_layer(layer_index):
            self.mlp = SparseMoE(cfg, shard, group, MLP)
        else:
            self.mlp = MLP(cfg, shard, group)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(
        self,
        normed: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        mixer = self.self_attn if self.linear_attn is None else self.linear_attn
        return mixer(normed, positions, batch, pool, cos_sin, ops)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Qwen3-Next's and Qwen3.5's weights under Hugging Face's names (a multimodal checkpoint's
    language model read as the text model's; Qwen3-Next's fused in_proj_qkvz and in_proj_ba
    un-interleaved into Qwen3.5's layout; stacked experts read per expert). Every RMSNorm
    weight holds 1 + the checkpoint's, added once at load, so the op table's norms compute the
    family's zero-centred ones; the DeltaNet's gated norm keeps its weight as it is."""

    decoder_layer = HybridDecoderLayer

    @property
    def eager_only(self) -> str | None:
        return "Gated DeltaNet layers split each sequence at block boundaries on the host"

    def load_weights(self, weights: Iterable[CheckpointTensor]) -> None:
        super().load_weights(self._text_weights(weights))
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)

    def _text_weights(self, weights: Iterable[CheckpointTensor]) -> Iterator[CheckpointTensor]:
        """The text model's weights under its own names, stacked experts as one tensor per
        expert and projection; the vision tower and the MTP layers left out."""
        for tensor in weights:
            if tensor.name.startswith(SKIPPED_PREFIXES):
                continue
            old, new = TEXT_PREFIX
            if tensor.name.startswith(old):
                tensor.name = new + tensor.name[len(old) :]
            stacked = STACKED_EXPERTS.fullmatch(tensor.name)
            if stacked is None:
                yield tensor
                continue
            yield from self._expert_parts(tensor, *stacked.groups())

    def _expert_parts(
        self, tensor: CheckpointTensor, experts: str, projection: str
    ) -> Iterator[CheckpointTensor]:
        cfg = self.config
        width, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        if projection == "gate_up_proj":
            _check(tensor, (cfg.num_experts, 2 * width, hidden))
            for e in range(cfg.num_experts):
                yield ExpertPart(tensor, f"{experts}.{e}.gate_proj.weight", e, 0, width)
                yield ExpertPart(tensor, f"{experts}.{e}.up_proj.weight", e, width, width)
        else:
            _check(tensor, (cfg.num_experts, hidden, width))
            for e in range(cfg.num_experts):
                yield ExpertPart(tensor, f"{experts}.{e}.down_proj.weight", e, 0, hidden)

    def _slices(self, mlp_width: int) -> dict[str, tuple[str, int, range, int, int]]:
        """Llama's, with q_proj twice as tall: each head's query rows, then its gate's."""
        cfg = self.config
        slices = super()._slices(mlp_width)
        rows = 2 * cfg.head_dim
        q = self.shard.q_heads(cfg.num_heads)
        q_rows = range(q.start * rows, q.stop * rows)
        kv_rows = slices["k_proj"][2]
        slices["q_proj"] = ("qkv_proj", 0, q_rows, cfg.num_heads * rows, 0)
        k_all = slices["k_proj"][3]
        slices["k_proj"] = ("qkv_proj", 0, kv_rows, k_all, len(q_rows))
        slices["v_proj"] = ("qkv_proj", 0, kv_rows, k_all, len(q_rows) + len(kv_rows))
        return slices

    def _loading_module(self, local: str) -> tuple[nn.Module, str] | None:
        match = LINEAR_WEIGHT.fullmatch(local)
        if match is None:
            return super()._loading_module(local)
        layer, part = match.groups()
        return self.layers[int(layer)].linear_attn, part

    def _checkpoint_names(self) -> list[str]:
        names = []
        linear = {i for i, layer in enumerate(self.layers) if layer.linear_attn is not None}
        for name in super()._checkpoint_names():
            parts = name.split(".")
            if parts[1] == "layers" and int(parts[2]) in linear and parts[3] == "self_attn":
                continue
            names.append(name)
        for i in sorted(linear):
            names += self.layers[i].linear_attn.checkpoint_names(f"model.layers.{i}.")
        return names


class ExpertPart:
    """One expert's projection inside a stacked experts tensor, read as a checkpoint tensor of
    its own: rows [offset, offset + rows) of expert `expert`'s matrix."""

    def __init__(
        self, stacked: CheckpointTensor, name: str, expert: int, offset: int, rows: int
    ) -> None:
        self.stacked = stacked
        self.name = name
        self.expert = expert
        self.offset = offset
        self.shape = (rows, stacked.shape[2])

    def read(
        self,
        rows: range | None = None,
        columns: range | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        rows = rows or range(self.shape[0])
        columns = columns or range(self.shape[1])
        rows = range(self.offset + rows.start, self.offset + rows.stop)
        return self.stacked.read_slices(self.expert, rows, columns, dtype=dtype)
