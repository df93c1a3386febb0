"""The scheme of a Hugging Face fine-grained FP8 checkpoint (DeepSeek-V3/R1, Qwen3-*-FP8), read
from its config's `quantization_config`; any other method or value is refused by field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.quant.scheme import QUANTIZABLE_PROJECTIONS
from pdserve.engine.quant.scheme import refuse as _refuse

if TYPE_CHECKING:
    from pdserve.engine.quant.fp8_experts import Fp8Experts
    from pdserve.engine.quant.fp8_linear import Fp8Linear
    from pdserve.engine.quant.linear import RankGroup


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """Block-scaled FP8 weights: each quantized linear's `weight` float8_e4m3fn [out, in] and
    `weight_scale_inv` float32 [ceil(out / block[0]), ceil(in / block[1])]; activations stay
    in the model's dtype (dynamic activation scales are a GPU kernel's business, not the
    weights'). not_converted: names that keep their plain weights (transformers' substring
    match of `modules_to_not_convert`)."""

    block: tuple[int, int]
    not_converted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, qcfg: dict) -> Fp8Scheme:
        method = qcfg.get("quant_method")
        if method != "fp8":
            raise _refuse("quant_method", method, "'fp8'")
        fmt = qcfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse("fmt", fmt, "'e4m3'")
        activations = qcfg.get("activation_scheme", "dynamic")
        if activations != "dynamic":
            raise _refuse("activation_scheme", activations, "'dynamic'")
        block = qcfg.get("weight_block_size")
        if (
            not isinstance(block, list | tuple)
            or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise _refuse("weight_block_size", block, "two positive integers, e.g. [128, 128]")
        not_converted: list[str] = []
        for field in ("modules_to_not_convert", "ignored_layers"):  # vLLM's name for it
            names = qcfg.get(field) or []
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise _refuse(field, names, "a list of module names")
            not_converted += names
        return cls(block=(block[0], block[1]), not_converted=tuple(not_converted))

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (its full name, e.g.
        model.layers.0.self_attn.q_proj) in FP8."""
        if module.rsplit(".", 1)[-1] not in QUANTIZABLE_PROJECTIONS:
            return False
        return not any(name in module for name in self.not_converted)

    @property
    def label(self) -> str:
        return f"fp8 e4m3, blocks of {self.block[0]}x{self.block[1]}"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale_inv")

    @property
    def alignment(self) -> tuple[int, int]:
        return self.block

    def linear(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        group: RankGroup | None,
    ) -> Fp8Linear:
        from pdserve.engine.quant.fp8_linear import Fp8Linear

        return Fp8Linear(in_features, out_parts, bias, self.block, group)

    def experts(self, num_experts: int, width: int, hidden_size: int) -> Fp8Experts:
        from pdserve.engine.quant.fp8_experts import Fp8Experts

        return Fp8Experts(num_experts, width, hidden_size, self.block)
