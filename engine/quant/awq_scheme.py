"""The scheme of an AWQ checkpoint as AutoAWQ publishes it (4-bit, GEMM packing, zero points),
read from its config's `quantization_config`; any other method or value is refused by field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.quant.scheme import config_field as field
from pdserve.engine.quant.scheme import not_converted, quantizes
from pdserve.engine.quant.scheme import refuse as _refuse

if TYPE_CHECKING:
    from pdserve.engine.quant.awq_linear import AwqLinear
    from pdserve.engine.quant.linear import RankGroup


@dataclass(frozen=True, slots=True)
class AwqScheme:
    """4-bit AWQ weights in AutoAWQ's GEMM layout (`awq_reference`): each quantized linear's
    `qweight`, `qzeros` and `scales`, in groups of `group_size` inputs; activations stay in
    the model's dtype. not_converted: names that keep their plain weights."""

    group_size: int
    not_converted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, qcfg: dict) -> AwqScheme:
        method = qcfg.get("quant_method")
        if method != "awq":
            raise _refuse("quant_method", method, "'awq'")
        name, version = field(qcfg, "version", default="gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise _refuse(name, version, "'gemm' (gemv, marlin and exllama pack otherwise)")
        name, backend = field(qcfg, "backend", default="autoawq")
        if backend != "autoawq":
            raise _refuse(name, backend, "'autoawq' (llm-awq packs otherwise)")
        name, bits = field(qcfg, "bits", "w_bit", default=4)
        if bits != 4:
            raise _refuse(name, bits, "4")
        name, group = field(qcfg, "group_size", "q_group_size", default=128)
        if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
            raise _refuse(name, group, "a positive number of inputs, e.g. 128")
        name, zero_point = field(qcfg, "zero_point", default=True)
        if zero_point is not True:
            raise _refuse(name, zero_point, "true (AWQ's GEMM layout with zero points)")
        return cls(group_size=group, not_converted=not_converted(qcfg))

    def quantizes(self, module: str) -> bool:
        return quantizes(module, self.not_converted)

    @property
    def label(self) -> str:
        return f"awq 4-bit gemm, groups of {self.group_size}"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    @property
    def alignment(self) -> tuple[int, int]:
        # Outputs are packed eight to a word; inputs split on group boundaries.
        return (8, self.group_size)

    def linear(
        self,
        in_features: int,
        out_parts: tuple[int, ...],
        bias: bool,
        group: RankGroup | None,
    ) -> AwqLinear:
        from pdserve.engine.quant.awq_linear import AwqLinear

        return AwqLinear(in_features, out_parts, bias, self.group_size, group)
