"""Multi-head latent attention (DeepSeek-V2 and V3) over a latent paged KV cache.

Per token and layer the cache holds one "head" of width kv_lora_rank + qk_rope_head_dim: the
normalised latent c_kv beside the rotated key part k_pe that every query head shares. Keys and
values are never decompressed: each query's no-rotary part is absorbed into latent space by
kv_b_proj's key half (W_UK), attention runs as multi-query attention over the latent pages
(`Ops.latent_attention`), and the attention-weighted latent goes to v-space through kv_b_proj's
value half (W_UV) before o_proj. `pdserve.kernels.mla_ref` shows why that equals DeepSeek's
per-head form; the tests check it does.

Tensor parallelism splits the query heads (q_proj or q_b_proj rows, kv_b_proj rows, o_proj
columns); the down-projections q_a_proj and kv_a_proj_with_mqa and the latent itself are whole
on every rank, as the latent has no heads to split: each rank's cache holds the same latent.

The input projections that read the hidden state (q_a_proj or q_proj, and kv_a_proj_with_mqa)
run as one matmul. DeepSeek's rotary pairs are interleaved, (2i, 2i + 1): loading reorders each
rotary part's rows so the projections emit the pairs as (i, i + d/2), which the op table's
rotary rotates; the cached k_pe is then in that order, the same on both sides of a handoff.

In a quantized checkpoint (DeepSeek-V3's FP8) the projections stay quantized (the scheme's layer),
their rows as stored: the rotary parts of their outputs are reordered instead, which a block's
shared scale allows whatever the block size. kv_b_proj, absorbed into w_uk and w_uv, is
dequantized once at load (it is small: 1/40 of V3's attention weights).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.norm import RMSNorm
from pdserve.engine.models.projection import projection
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.op_table import Ops


class LatentAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.layer_index = layer_index
        self.heads = shard.q_heads(cfg.num_heads)
        self.num_heads = len(self.heads)
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.lora, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        self.qk_dim = self.nope + self.rope
        self.q_lora = cfg.q_lora_rank
        # What the hidden state projects to: q's low-rank code (whole) or this rank's heads' q,
        # then the latent and k_pe (whole).
        self.q_width = self.q_lora or self.num_heads * self.qk_dim
        p = f"model.layers.{layer_index}.self_attn."
        q_name = p + ("q_a_proj" if self.q_lora else "q_proj")
        self.in_proj = projection(
            cfg,
            [q_name, p + "kv_a_proj_with_mqa"],
            cfg.hidden_size,
            (self.q_width, self.lora + self.rope),
            False,
        )
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(self.q_lora, cfg.rms_norm_eps)
            self.q_b_proj = projection(
                cfg, [p + "q_b_proj"], self.q_lora, (self.num_heads * self.qk_dim,), False
            )
        else:
            self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_layernorm = RMSNorm(self.lora, cfg.rms_norm_eps)
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope, self.lora))
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.v_dim, self.lora))
        self.o_proj = projection(
            cfg,
            [p + "o_proj"],
            self.num_heads * self.v_dim,
            (cfg.hidden_size,),
            False,
            group,
            row_parallel=True,
        )
        self.scale = cfg.attention_scale
        # Quantized layers keep DeepSeek's interleaved rotary rows: their outputs are reordered.
        q_layer = self.q_b_proj if self.q_lora else self.in_proj
        interleaved = cfg.rope_interleave
        self.reorder_q_pe = interleaved and isinstance(q_layer, QuantLinear)
        self.reorder_k_pe = interleaved and isinstance(self.in_proj, QuantLinear)
        scheme = cfg.quantization
        self.kv_b_quantized = scheme is not None and scheme.quantizes(p + "kv_b_proj")
        self._kv_b_parts: dict[str, CheckpointTensor] = {}

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, c_kv, k_pe = self.in_proj(hidden).split([self.q_width, self.lora, self.rope], dim=-1)
        if self.q_b_proj is not None:
            q = ops.rms_norm(q.contiguous(), self.q_a_layernorm.weight, self.q_a_layernorm.eps)
            q = self.q_b_proj(q)
        q = q.reshape(num_tokens, self.num_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        if self.reorder_q_pe:
            q_pe = _halves(q_pe)
        if self.reorder_k_pe:
            k_pe = _halves(k_pe)
        c_kv = ops.rms_norm(c_kv.contiguous(), self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        q_pe, k_pe = ops.apply_rotary(
            q_pe, k_pe.reshape(num_tokens, 1, self.rope), positions, cos_sin
        )
        latent = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [T, 1, L + R]
        (cache,) = pool.layer(self.layer_index)
        ops.store_latent(latent, cache, batch.slot_mapping)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [H, T, L]
        query = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1)  # [T, H, L + R]
        out = ops.latent_attention(
            query,
            cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            self.scale,
            batch.max_query_len,
            self.lora,
        )
        out = torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2))  # [H, T, V]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, self.num_heads * self.v_dim))

    # --- loading -------------------------------------------------------------------------------

    def checkpoint_names(self, prefix: str) -> list[str]:
        """This layer's attention weights as DeepSeek's checkpoints name them."""
        p = prefix + "self_attn."
        if self.q_lora:
            names = [p + "q_a_proj.weight", p + "q_a_layernorm.weight", p + "q_b_proj.weight"]
        else:
            names = [p + "q_proj.weight"]
        return names + [
            p + "kv_a_proj_with_mqa.weight",
            p + "kv_a_layernorm.weight",
            p + "kv_b_proj.weight",
            p + "o_proj.weight",
        ]

    def load(self, part: str, tensor: CheckpointTensor) -> None:
        """Read this rank's part of one checkpoint weight (`part`: its name after `self_attn.`,
        e.g. `kv_b_proj.weight`); raise naming it if misshapen."""
        cfg = self.config
        hidden, heads, hd = cfg.hidden_size, self.heads, self.qk_dim
        kv_a_rows = range(self.q_width, self.q_width + self.lora + self.rope)
        whole_heads = cfg.num_heads
        rows = range(heads.start * hd, heads.stop * hd)
        name, kind = part.rsplit(".", 1)
        quantized = {
            "q_a_proj": (self.in_proj, 0, range(self.q_lora), self.q_lora, 0),
            "q_proj": (self.in_proj, 0, rows, whole_heads * hd, 0),
            "kv_a_proj_with_mqa": (
                self.in_proj,
                0,
                range(self.lora + self.rope),
                self.lora + self.rope,
                self.q_width,
            ),
            "q_b_proj": (self.q_b_proj, 0, rows, whole_heads * hd, 0),
            "o_proj": (
                self.o_proj,
                1,
                range(heads.start * self.v_dim, heads.stop * self.v_dim),
                whole_heads * self.v_dim,
                0,
            ),
        }.get(name)
        if quantized is not None and isinstance(quantized[0], QuantLinear):
            layer, dim, share, size, offset = quantized
            if kind not in layer.kinds:
                raise ValueError(f"unexpected weight '{tensor.name}' in checkpoint")
            layer.load(kind, tensor, dim, share, size, offset)
            return
        if name == "kv_b_proj" and self.kv_b_quantized:
            self._load_quantized_kv_b(kind, tensor)
            return
        if part == "q_a_proj.weight":
            self._check(tensor, (self.q_lora, hidden))
            self._copy(self.in_proj.weight.data[: self.q_lora], tensor.read())
        elif part == "q_proj.weight":
            self._check(tensor, (whole_heads * hd, hidden))
            w = self._rope_rows(tensor.read(rows=rows).view(self.num_heads, hd, hidden), self.nope)
            self._copy(self.in_proj.weight.data[: self.q_width], w.reshape(-1, hidden))
        elif part == "q_b_proj.weight":
            self._check(tensor, (whole_heads * hd, self.q_lora))
            w = tensor.read(rows=rows).view(self.num_heads, hd, self.q_lora)
            w = self._rope_rows(w, self.nope).reshape(-1, self.q_lora)
            self._copy(self.q_b_proj.weight.data, w)
        elif part == "kv_a_proj_with_mqa.weight":
            self._check(tensor, (self.lora + self.rope, hidden))
            w = self._rope_rows(tensor.read().unsqueeze(0), self.lora)[0]
            self._copy(self.in_proj.weight.data[kv_a_rows.start : kv_a_rows.stop], w)
        elif part == "kv_b_proj.weight":
            per = self.nope + self.v_dim
            self._check(tensor, (whole_heads * per, self.lora))
            w = tensor.read(rows=range(heads.start * per, heads.stop * per))
            w = w.view(self.num_heads, per, self.lora)
            self._copy(self.w_uk.data, w[:, : self.nope])
            self._copy(self.w_uv.data, w[:, self.nope :])
        elif part == "o_proj.weight":
            whole = whole_heads * self.v_dim
            self._check(tensor, (hidden, whole))
            cols = range(heads.start * self.v_dim, heads.stop * self.v_dim)
            self._copy(self.o_proj.weight.data, tensor.read(columns=cols))
        elif part == "q_a_layernorm.weight" and self.q_lora:
            self._check(tensor, (self.q_lora,))
            self._copy(self.q_a_layernorm.weight.data, tensor.read())
        elif part == "kv_a_layernorm.weight":
            self._check(tensor, (self.lora,))
            self._copy(self.kv_a_layernorm.weight.data, tensor.read())
        else:
            raise ValueError(f"unexpected weight '{tensor.name}' in checkpoint")

    def _load_quantized_kv_b(self, kind: str, tensor: CheckpointTensor) -> None:
        """kv_b_proj's tensors in the scheme's layer; once all are read, dequantized once into
        this rank's heads' w_uk and w_uv (the whole projection is read: it is small, and a
        rank's heads need not start on a block)."""
        scheme = self.config.quantization
        if kind not in scheme.tensor_names:
            raise ValueError(f"unexpected weight '{tensor.name}' in checkpoint")
        self._kv_b_parts[kind] = tensor
        if set(self._kv_b_parts) != set(scheme.tensor_names):
            return
        per = self.nope + self.v_dim
        whole = self.config.num_heads * per
        layer = scheme.linear(self.lora, (whole,), False, None)
        for part_kind, part in self._kv_b_parts.items():
            layer.load(part_kind, part, 0, range(whole), whole, 0)
        self._kv_b_parts.clear()
        heads = self.heads
        w = layer.dequantized(torch.float32)[heads.start * per : heads.stop * per]
        w = w.view(self.num_heads, per, self.lora)
        self._copy(self.w_uk.data, w[:, : self.nope])
        self._copy(self.w_uv.data, w[:, self.nope :])

    def _rope_rows(self, w: torch.Tensor, start: int) -> torch.Tensor:
        """w [n, rows, in]: reorder rows [start, start + R) of each from interleaved rotary pairs
        (2i, 2i + 1) to halves (i, i + R/2), where the config says the pairs interleave."""
        if not self.config.rope_interleave:
            return w
        order = torch.cat([torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)])
        w = w.clone()
        w[:, start : start + self.rope] = w[:, start + order]
        return w

    @staticmethod
    def _check(tensor: CheckpointTensor, full: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"weight '{tensor.name}' has shape {tuple(tensor.shape)}, expected {full}"
            )

    @staticmethod
    def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
        with torch.no_grad():
            dest.copy_(src.to(dest.dtype))


def _halves(x: torch.Tensor) -> torch.Tensor:
    """x [..., R] with its rotary pairs interleaved, (2i, 2i + 1), as (i, i + R/2)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
