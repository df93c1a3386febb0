"""How a quantized checkpoint's projections are held on a node, in bytes, for the tuner: the
layouts of `pdserve.engine.quant`'s layers (compressed-tensors, AWQ, GPTQ, MXFP4 experts) read
from a config's `quantization_config`, so a roofline reads the bytes a node really streams.

Per projection of `rows` outputs and `cols` inputs, as the layers hold them on one rank:
compressed-tensors FP8 and INT8 one byte a weight and a float32 scale per row and group;
its W4A16 int32 words of eight values, float32 scales and, asymmetric, an int8 zero point per
row and group; AWQ half a byte a weight, float16 scales and 4-bit zero points per group and
output; GPTQ `bits` a weight in int32 words, the same scales and zero points, and an int32
group index per input; MXFP4 (gpt-oss's experts only) half a byte a weight and a byte of
exponent per 32. Block-scaled FP8 is `ModelShape.fp8_block`'s, not this."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.quant.awq_scheme import AwqScheme
from pdserve.engine.quant.compressed_tensors_scheme import CompressedTensorsScheme
from pdserve.engine.quant.gptq_scheme import GptqScheme
from pdserve.engine.quant.mxfp4_scheme import Mxfp4Scheme

WORD = 4  # bytes of an int32 word
MXFP4_BLOCK = 32


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """kind: `fp8` or `int8` (compressed-tensors, one byte a weight), `int4` (compressed-tensors
    W4A16), `awq`, `gptq` or `mxfp4`; group: inputs per scale (0: one per output row, GPTQ's
    group_size -1); bits: GPTQ's 4 or 8; zeros: zero points held (asymmetric W4A16)."""

    kind: str
    group: int = 0
    bits: int = 4
    zeros: bool = False

    @property
    def experts_only(self) -> bool:
        """MXFP4 quantizes gpt-oss's routed experts; every other projection stays float."""
        return self.kind == "mxfp4"

    @property
    def label(self) -> str:
        groups = f"groups of {self.group}" if self.group else "scales per output"
        if self.kind == "mxfp4":
            return "mxfp4 experts"
        if self.kind == "gptq":
            return f"gptq {self.bits}-bit, {groups}"
        return f"{self.kind}, {groups}"

    def _groups(self, cols: int) -> int:
        return -(-cols // self.group) if self.group else 1

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """One quantized projection [rows, cols] as its layer holds it."""
        groups = self._groups(cols)
        if self.kind in ("fp8", "int8"):  # ScaledInt8Fp8Linear
            return rows * cols + 4 * rows * groups
        if self.kind == "int4":  # PackedInt4Linear
            zeros = rows * groups if self.zeros else 0
            return WORD * rows * -(-cols // 8) + 4 * rows * groups + zeros
        if self.kind == "awq":  # AwqLinear: qweight, qzeros (eight a word), float16 scales
            return WORD * cols * rows // 8 + WORD * groups * rows // 8 + 2 * groups * rows
        if self.kind == "gptq":  # GptqLinear: qweight, qzeros, scales, g_idx
            per_word = 32 // self.bits
            qweight = WORD * -(-cols // per_word) * rows
            return qweight + WORD * groups * rows // per_word + 2 * groups * rows + WORD * cols
        if self.kind == "mxfp4":  # Mxfp4Experts: blocks and E8M0 scales
            return rows * cols // 2 + rows * cols // MXFP4_BLOCK
        raise ValueError(f"unknown weight format {self.kind!r}")

    @classmethod
    def from_scheme(cls, scheme: object) -> WeightFormat | None:
        """The format of a loaded scheme (`ModelConfig.quantization`); None for any other."""
        if isinstance(scheme, CompressedTensorsScheme):
            group = scheme.group_size or 0 if scheme.strategy == "group" else 0
            return cls(scheme.kind, group=group, zeros=not scheme.symmetric)
        if isinstance(scheme, AwqScheme):
            return cls("awq", group=scheme.group_size)
        if isinstance(scheme, GptqScheme):
            group = 0 if scheme.group_size == -1 else scheme.group_size
            return cls("gptq", group=group, bits=scheme.bits)
        if isinstance(scheme, Mxfp4Scheme):
            return cls("mxfp4")
        return None
