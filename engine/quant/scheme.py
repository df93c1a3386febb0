"""What every quantized checkpoint's scheme tells the models: which projections it quantizes,
the tensors that stand for each one's `weight` in the checkpoint, the layer that keeps them in
memory, and the grid a tensor-parallel rank's share must start on. Each format
(`fp8_scheme.Fp8Scheme`, ...) implements it; `schemes.scheme_from_config` picks one by the
config's `quant_method`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.engine.quant.experts import QuantExperts
    from pdserve.engine.quant.linear import QuantLinear, RankGroup

# The projections a checkpoint may quantize, by their last name: a dense Llama-family layer's,
# an expert's (Mixtral's w1/w3/w2 too) and DeepSeek's latent attention's. Embeddings, lm_head and
# a mixture of experts' router (`mlp.gate`) stay unquantized.
QUANTIZABLE_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "w1",  # Mixtral's experts: gate, down, up
    "w2",
    "w3",
    "q_a_proj",  # multi-head latent attention (DeepSeek-V2/V3)
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)


class UnsupportedQuantizationError(ValueError):
    """A checkpoint's quantization_config names a method or value this engine does not run."""


def refuse(field: str, value: object, supported: str) -> UnsupportedQuantizationError:
    """The error naming the `quantization_config` field whose value is not run."""
    return UnsupportedQuantizationError(
        f"config.json field 'quantization_config.{field}' = {value!r} is not supported "
        f"(supported: {supported})"
    )


def not_converted(qcfg: dict) -> tuple[str, ...]:
    """`modules_to_not_convert` (transformers' substring match), checked to be a list."""
    names = qcfg.get("modules_to_not_convert") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise refuse("modules_to_not_convert", names, "a list of module names")
    return tuple(names)


def quantizes(module: str, skipped: tuple[str, ...]) -> bool:
    """Whether a checkpoint that skips `skipped` holds `module` (its full name) quantized."""
    if module.rsplit(".", 1)[-1] not in QUANTIZABLE_PROJECTIONS:
        return False
    return not any(name in module for name in skipped)


def config_field(qcfg: dict, *names: str, default: object = None) -> tuple[str, object]:
    """(the name, the value) of the first of `names` the config holds (AutoAWQ's own config
    spells some fields differently from transformers'), else of the first with `default`."""
    for name in names:
        if name in qcfg:
            return name, qcfg[name]
    return names[0], default


class QuantScheme(Protocol):
    @property
    def label(self) -> str:
        """How the start-up line names the format (e.g. `fp8 e4m3, blocks of 128x128`)."""
        ...

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The tensors a quantized projection holds in the checkpoint in place of `weight`
        (e.g. `weight`, `weight_scale_inv`), each required."""
        ...

    @property
    def alignment(self) -> tuple[int, int]:
        """The multiple (output rows, input columns) a tensor-parallel rank's share of a
        quantized projection must start at: its packed words, blocks or groups stay whole."""
        ...

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (its full name, e.g.
        model.layers.0.self_attn.q_proj) quantized."""
        ...

    def linear(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        group: RankGroup | None,
    ) -> QuantLinear:
        """The layer of a (fused) quantized projection: `out_parts` its parts' output rows;
        with a group, row-parallel (its input this rank's share, its outputs summed)."""
        ...


class ExpertScheme(QuantScheme, Protocol):
    """A scheme whose experts stay quantized too (a mixture of experts' checkpoint): the models
    refuse such a checkpoint under a scheme without `experts`."""

    def experts(self, num_experts: int, width: int, hidden_size: int) -> QuantExperts:
        """Every expert's gate/up and down projections stacked, quantized: this rank's `width`
        columns of each."""
        ...
