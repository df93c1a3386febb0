"""The scheme of gpt-oss's published checkpoints (`quant_method: mxfp4`): every layer's experts in
MXFP4, everything else (attention, router, embeddings, lm_head) in float; any other method or
value is refused by field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.quant.mxfp4_reference import BLOCK
from pdserve.engine.quant.scheme import refuse as _refuse

if TYPE_CHECKING:
    from pdserve.engine.quant.linear import QuantLinear, RankGroup
    from pdserve.engine.quant.mxfp4_experts import Mxfp4Experts


def _kept_float(module: str, pattern: str) -> bool:
    """Whether `modules_to_not_convert`'s `pattern` names `module` as transformers reads it: a
    regular expression from the start up to a module boundary (`model.layers.*.self_attn`), or
    a suffix (`lm_head`)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    try:
        return re.match(rf"(?:{pattern}){boundary}", module) is not None or module.endswith(pattern)
    except re.error:
        return module.endswith(pattern)


@dataclass(frozen=True, slots=True)
class Mxfp4Scheme:
    """gpt-oss's MXFP4 experts: each layer's `mlp.experts.gate_up_proj_blocks` and
    `down_proj_blocks` uint8 [experts, out, in / 32, 16] (two FP4 e2m1 values a byte) with
    `..._scales` uint8 [experts, out, in / 32] (E8M0 exponents), their biases in float; the
    other projections stay float. not_converted: `modules_to_not_convert`'s patterns."""

    not_converted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, qcfg: dict) -> Mxfp4Scheme:
        method = qcfg.get("quant_method")
        if method != "mxfp4":
            raise _refuse("quant_method", method, "'mxfp4'")
        names = qcfg.get("modules_to_not_convert") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _refuse("modules_to_not_convert", names, "a list of module names")
        # transformers' load-time option (dequantize to bf16): the weights here stay packed
        # either way, so either value loads the same checkpoint.
        dequantize = qcfg.get("dequantize", False)
        if not isinstance(dequantize, bool):
            raise _refuse("dequantize", dequantize, "true or false")
        return cls(not_converted=tuple(names))

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (its full name, e.g.
        model.layers.0.mlp.experts) in MXFP4: gpt-oss's experts, unless kept float."""
        if not module.endswith("mlp.experts"):
            return False
        return not any(_kept_float(module, pattern) for pattern in self.not_converted)

    @property
    def label(self) -> str:
        return f"mxfp4 (e2m1 in blocks of {BLOCK}, e8m0 scales)"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Each quantized expert projection's suffixes (`gate_up_proj_blocks`, ...)."""
        return ("blocks", "scales")

    @property
    def alignment(self) -> tuple[int, int]:
        # Any split: a rank reads the whole blocks that hold its share of the experts.
        return (1, 1)

    def linear(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        group: RankGroup | None,
    ) -> QuantLinear:
        raise ValueError(
            "quantization_config.quant_method 'mxfp4' quantizes gpt-oss's experts only, "
            "not a linear projection"
        )

    def experts(self, num_experts: int, hidden: int, width: int, columns: range) -> Mxfp4Experts:
        """The layer holding this rank's `columns` (of `width`) of every expert in MXFP4."""
        from pdserve.engine.quant.mxfp4_experts import Mxfp4Experts

        return Mxfp4Experts(num_experts, hidden, width, columns)
