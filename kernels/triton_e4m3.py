"""FP8 e4m3 (float8_e4m3fn) in Triton by bit arithmetic: decoding stored bytes to float32 and
rounding float32 onto the e4m3 grid, so that the same code is exact on every GPU (including
those before FP8 conversions, capability < 8.9) and under Triton's CPU interpreter, whose
float32 -> float8 cast is wrong whenever rounding carries into the exponent (31.6 becomes 16,
not 32)."""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude < 2**22 to an integer,
# ties to even (float32 addition rounds so).
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def e4m3_to_float32(bits):
    """float32 values of e4m3fn bytes (any integer tensor holding 0..255): sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 is subnormal, m * 2**-9. NaN (0x7f, 0xff) is not
    decoded: quantizers never write it."""
    b = bits.to(tl.int32) & 0xFF
    sign = (b & 0x80) << 24
    # A normal e4m3 is float32 with exponent e - 7 + 127: its 7 low bits shifted into place,
    # the exponent rebased by 120.
    normal = (((b & 0x7F) + (120 << 3)) << 20) | sign
    subnormal = (b & 0x07).to(tl.float32) * 0.001953125  # m * 2**-9
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    return tl.where((b & 0x78) == 0, subnormal, normal.to(tl.float32, bitcast=True))


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32:
    its cast to float8e4nv is then exact on a GPU and in the interpreter alike."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2**-6 the grid is the subnormals' 2**-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    return ((v / step + _ROUND_MAGIC) - _ROUND_MAGIC) * step
