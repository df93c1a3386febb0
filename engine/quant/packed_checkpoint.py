"""Writing a float checkpoint in AutoAWQ's GEMM layout or in AutoGPTQ's / GPTQModel's layout,
for tests and benchmarks: each linear projection quantized round-to-nearest per group by the
format's reference (`awq_reference.quantize`, `gptq_reference.quantize`), the rest copied, and
config.json's quantization_config as those tools write it.

    from pdserve.engine.quant.packed_checkpoint import write_awq_checkpoint, write_gptq_checkpoint
    write_awq_checkpoint(Path("bf16-model"), Path("awq-model"), group_size=128)
    write_gptq_checkpoint(Path("bf16-model"), Path("gptq-model"), group_size=128, desc_act=True)
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.quant import awq_reference, gptq_reference
from pdserve.engine.quant.scheme import quantizes

# A projection's float weight [out, in] and its full name -> the tensors that replace `weight`.
Quantizer = Callable[[torch.Tensor, str], dict[str, torch.Tensor]]


def write_awq_checkpoint(
    src: Path, out_dir: Path, group_size: int, not_converted: tuple[str, ...] = ()
) -> Path:
    """A copy of the float checkpoint `src` as AutoAWQ publishes it (4-bit GEMM, zero points):
    each linear projection's `qweight`, `qzeros` and `scales` (`awq_reference`)."""

    def quantize(weight: torch.Tensor, module: str) -> dict[str, torch.Tensor]:
        qweight, qzeros, scales = awq_reference.quantize(weight, group_size)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}

    qcfg = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(not_converted) or None,
    }
    return _write(src, out_dir, quantize, qcfg, not_converted)


def write_gptq_checkpoint(
    src: Path,
    out_dir: Path,
    group_size: int,
    bits: int = 4,
    desc_act: bool = False,
    sym: bool = True,
    checkpoint_format: str = "gptq",
) -> Path:
    """A copy of the float checkpoint `src` as AutoGPTQ (`checkpoint_format` "gptq", zero points
    stored minus one) or GPTQModel ("gptq_v2") publish it: each linear projection's `qweight`,
    `qzeros`, `scales` and `g_idx` (`gptq_reference`). With desc_act each projection's inputs
    are grouped in an order of their own (seeded by its name), as act-order leaves them."""
    v1 = {"gptq": True, "gptq_v2": False}[checkpoint_format]

    def quantize(weight: torch.Tensor, module: str) -> dict[str, torch.Tensor]:
        seed = zlib.crc32(module.encode()) if desc_act else None
        g_idx = gptq_reference.act_order_groups(weight.shape[1], group_size, seed)
        qweight, qzeros, scales = gptq_reference.quantize(weight, g_idx, bits, sym, v1)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}

    qcfg = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": checkpoint_format,
    }
    return _write(src, out_dir, quantize, qcfg, ())


def _write(
    src: Path, out_dir: Path, quantize: Quantizer, qcfg: dict, not_converted: tuple[str, ...]
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and quantizes(module, not_converted):
            for kind, packed in quantize(tensor.float(), module).items():
                written[f"{module}.{kind}"] = packed
        else:
            written[name] = tensor
    save_file(written, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qcfg
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy(path, out_dir / path.name)
    return out_dir
