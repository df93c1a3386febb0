"""The scheme of a GPTQ checkpoint as AutoGPTQ and GPTQModel publish it (4 or 8 bits, groups or
one per output, with or without act-order, symmetric or not, zero points in the v1 or v2
convention), read from its config's `quantization_config`; any other value is refused by field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.quant.scheme import config_field as field
from pdserve.engine.quant.scheme import not_converted, quantizes
from pdserve.engine.quant.scheme import refuse as _refuse

if TYPE_CHECKING:
    from pdserve.engine.quant.gptq_linear import GptqLinear
    from pdserve.engine.quant.linear import RankGroup

# checkpoint_format -> whether zero points are stored minus one (`gptq_reference`).
FORMATS = {"gptq": True, "gptq_v2": False}


@dataclass(frozen=True, slots=True)
class GptqScheme:
    """GPTQ weights (`gptq_reference`): each quantized linear's `qweight`, `qzeros`, `scales`
    and `g_idx`; activations stay in the model's dtype. group_size -1: one group of all inputs.
    desc_act: inputs grouped in act-order (any `g_idx`). v1: zero points stored minus one."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    v1: bool = True
    not_converted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, qcfg: dict) -> GptqScheme:
        method = qcfg.get("quant_method")
        if method != "gptq":
            raise _refuse("quant_method", method, "'gptq'")
        bits = qcfg.get("bits")
        if bits not in (4, 8) or isinstance(bits, bool):
            raise _refuse("bits", bits, "4, 8")
        group = qcfg.get("group_size", 128)
        if not isinstance(group, int) or isinstance(group, bool) or (group <= 0 and group != -1):
            raise _refuse("group_size", group, "a positive number of inputs, or -1 (per output)")
        flags = {}
        for name, default in (("desc_act", False), ("sym", True)):
            flags[name] = qcfg.get(name, default)
            if not isinstance(flags[name], bool):
                raise _refuse(name, flags[name], "true, false")
        name, fmt = field(qcfg, "checkpoint_format", "format", default="gptq")
        if fmt not in FORMATS:
            raise _refuse(name, fmt, ", ".join(repr(f) for f in FORMATS))
        for name in ("dynamic", "modules_in_block_to_quantize"):  # per-module exceptions
            if qcfg.get(name):
                raise _refuse(name, qcfg[name], "none (every projection quantized alike)")
        if qcfg.get("lm_head"):
            raise _refuse("lm_head", qcfg["lm_head"], "false (lm_head kept unquantized)")
        return cls(
            bits=bits,
            group_size=group,
            desc_act=flags["desc_act"],
            sym=flags["sym"],
            v1=FORMATS[fmt],
            not_converted=not_converted(qcfg),
        )

    def quantizes(self, module: str) -> bool:
        return quantizes(module, self.not_converted)

    @property
    def label(self) -> str:
        groups = "per output" if self.group_size == -1 else f"groups of {self.group_size}"
        order = ", act-order" if self.desc_act else ""
        kind = "symmetric" if self.sym else "asymmetric"
        return f"gptq {self.bits}-bit {kind}, {groups}{order}"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    @property
    def alignment(self) -> tuple[int, int]:
        # Zero points pack the outputs, qweight the inputs, 32 / bits to a word; a rank keeps
        # only its own inputs' groups unless act-order lets any input be in any group.
        per_word = 32 // self.bits
        whole_groups = self.group_size > 0 and not self.desc_act
        return (per_word, math.lcm(per_word, self.group_size) if whole_groups else per_word)

    def linear(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        group: RankGroup | None,
    ) -> GptqLinear:
        from pdserve.engine.quant.gptq_linear import GptqLinear

        return GptqLinear(
            in_features,
            out_parts,
            bias,
            self.bits,
            self.group_size,
            self.desc_act,
            self.v1,
            group,
        )
