"""Gemma 3's text decoder, from a `Gemma3ForCausalLM` checkpoint or the language model of a
multimodal `Gemma3ForConditionalGeneration` one: Llama's paged attention, step loop and loading,
with Gemma's scaled embedding, (1 + weight) RMSNorms around attention and the MLP, a GeGLU MLP, a
rope base of its own for the sliding layers, `query_pre_attn_scalar` and a tanh cap on the
logits."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from pdserve.engine.models.norm import RMSNorm
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.op_table import Ops

# A multimodal checkpoint's language model, as transformers 4.x (the Hub's Gemma 3 releases) and
# 5.x save it, by the prefix of its names; the vision tower and its projector are not loaded.
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# transformers' activation by its name: gelu_pytorch_tanh is the tanh approximation.
GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GemmaAttention(Attention):
    """Llama's attention (q/k RMSNorm on, as Gemma 3 always has it), its softmax scaled by
    query_pre_attn_scalar ** -0.5, its rotary table the sliding layers' or the full layers'."""

    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        super().__init__(cfg, layer_index, shard, group)
        self.scale = cfg.attention_scale
        # Its table in the model's `cos_sin`: 0 the full layers', 1 the sliding layers'.
        self.rope = int(layer_index in cfg.local_rope_layers)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        cos_sin: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        """cos_sin: the model's two tables [2, positions, head_dim]; this layer reads its own."""
        return super().forward(hidden, positions, batch, pool, cos_sin[self.rope], ops)


class GeGLU(MLP):
    """down(gelu(gate(x)) * up(x)), the gate and up projections fused as Llama's."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup | None) -> None:
        super().__init__(cfg, shard, group)
        self.approximate = GELU_APPROXIMATION[cfg.mlp_activation]

    def forward(self, x: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma3DecoderLayer(DecoderLayer):
    """Sandwich norms: attention and the MLP each between a norm of their input and one of their
    output, before the residual add."""

    def __init__(
        self, cfg: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup | None
    ) -> None:
        nn.Module.__init__(self)  # Gemma's attention and MLP, not Llama's choice of them
        self.self_attn = GemmaAttention(cfg, layer_index, shard, group)
        self.mlp = GeGLU(cfg, shard, group)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def feed_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output normed before it joins the stream, the MLP's input normed as
        Llama's, and the MLP's output normed."""
        norm = self.post_attention_layernorm
        hidden = ops.rms_norm(hidden, norm.weight, norm.eps)
        norm = self.pre_feedforward_layernorm
        normed, residual = ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.mlp(normed, ops)
        norm = self.post_feedforward_layernorm
        return ops.rms_norm(hidden, norm.weight, norm.eps), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's weights under Hugging Face's names (a multimodal checkpoint's language model read
    as a `Gemma3ForCausalLM`'s), fused as Llama's. Every RMSNorm weight holds 1 + the
    checkpoint's, added once at load, so the op table's norms (x * weight) compute Gemma's."""

    decoder_layer = Gemma3DecoderLayer

    def __init__(
        self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None
    ) -> None:
        super().__init__(cfg, shard, group)
        self.embed_scale = cfg.hidden_size**0.5  # rounded to the model's dtype by make_tables

    @staticmethod
    def _rotary_table(cfg: ModelConfig) -> torch.Tensor:
        """[2, positions, head_dim]: the full layers' table (rope_theta, rope_scaling) and the
        sliding layers' (their own base and scaling)."""
        local = dataclasses.replace(
            cfg, rope_theta=cfg.local_rope_theta, rope_scaling=cfg.local_rope_scaling
        )
        return torch.stack(
            [LlamaForCausalLM._rotary_table(cfg), LlamaForCausalLM._rotary_table(local)]
        )

    def make_tables(self, device: str | torch.device) -> None:
        super().make_tables(device)
        # sqrt(hidden_size) rounded to the model's dtype, as transformers scales the embedding
        # (in bfloat16, sqrt(3072) = 55.43 becomes 55.5).
        dtype = self.embed_tokens.weight.dtype
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5).to(dtype).item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap

    # --- loading -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[CheckpointTensor]) -> None:
        super().load_weights(self._text_weights(weights))
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)

    def _text_weights(self, weights: Iterable[CheckpointTensor]) -> Iterator[CheckpointTensor]:
        """A multimodal checkpoint's language model under `Gemma3ForCausalLM`'s names, its
        vision tower and projector left out; a text checkpoint's weights as they are."""
        for tensor in weights:
            if self.config.model_type == "gemma3":
                if tensor.name.startswith(VISION_PREFIXES):
                    continue
                for prefix, text in TEXT_PREFIXES.items():
                    if tensor.name.startswith(prefix):
                        tensor.name = text + tensor.name[len(prefix) :]
                        break
            yield tensor

    def _checkpoint_names(self) -> list[str]:
        names = super()._checkpoint_names()
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            names += [
                p + "pre_feedforward_layernorm.weight",
                p + "post_feedforward_layernorm.weight",
            ]
        return names
