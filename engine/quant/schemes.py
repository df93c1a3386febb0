"""The scheme of a quantized checkpoint, chosen by its config's `quantization_config.quant_method`;
any other method is refused by field."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.quant.awq_scheme import AwqScheme
from pdserve.engine.quant.compressed_tensors_scheme import CompressedTensorsScheme
from pdserve.engine.quant.fp8_scheme import Fp8Scheme
from pdserve.engine.quant.gptq_scheme import GptqScheme
from pdserve.engine.quant.mxfp4_scheme import Mxfp4Scheme
from pdserve.engine.quant.scheme import QuantScheme, refuse

# quant_method -> the scheme read from the whole quantization_config.
SCHEMES: dict[str, Callable[[dict], QuantScheme]] = {
    "fp8": Fp8Scheme.from_config,
    "compressed-tensors": CompressedTensorsScheme.from_config,
    "awq": AwqScheme.from_config,
    "gptq": GptqScheme.from_config,
    "mxfp4": Mxfp4Scheme.from_config,
}


def scheme_from_config(qcfg: dict) -> QuantScheme:
    method = qcfg.get("quant_method")
    reader = SCHEMES.get(method) if isinstance(method, str) else None
    if reader is None:
        raise refuse("quant_method", method, ", ".join(repr(m) for m in SCHEMES))
    return reader(qcfg)
