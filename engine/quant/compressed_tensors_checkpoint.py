"""Writing a float checkpoint in the compressed-tensors layout llm-compressor publishes, for tests
and benchmarks: each targeted projection quantized by the reference
(`compressed_tensors_reference`), the rest copied, and config.json's `quantization_config` as
llm-compressor writes it. `PRESETS` names llm-compressor's usual schemes.

    from pdserve.engine.quant.compressed_tensors_checkpoint import PRESETS, write_compressed_tensors_checkpoint
    write_compressed_tensors_checkpoint(Path("bf16-model"), Path("w4a16"), PRESETS["W4A16"])
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.quant.compressed_tensors_reference import (
    FP8_MAX,
    pack_int4,
    quantize_fp8,
    quantize_int,
)
from pdserve.engine.quant.compressed_tensors_scheme import CompressedTensorsScheme

# llm-compressor's preset schemes (its `preset_name_to_scheme`), the head left unquantized.
PRESETS = {
    "W4A16": CompressedTensorsScheme("int4", "group", 128, ignore=("lm_head",)),
    "W4A16_ASYM": CompressedTensorsScheme(
        "int4", "group", 128, symmetric=False, ignore=("lm_head",)
    ),
    "W8A8": CompressedTensorsScheme("int8", "channel", ignore=("lm_head",)),
    "FP8": CompressedTensorsScheme("fp8", "tensor", static_input=True, ignore=("lm_head",)),
    "FP8_DYNAMIC": CompressedTensorsScheme("fp8", "channel", ignore=("lm_head",)),
}
# The static activation scale written for FP8 (static): activations up to 8 in magnitude. A real
# one comes from calibration; pdserve reads it and does not apply it.
STATIC_INPUT_SCALE = 8.0 / FP8_MAX


def quantization_config(scheme: CompressedTensorsScheme) -> dict:
    """config.json's `quantization_config` for `scheme`, field for field as llm-compressor writes
    it (one config group)."""
    fmt = {"fp8": "float-quantized", "int8": "int-quantized", "int4": "pack-quantized"}
    weights = {
        "num_bits": 4 if scheme.kind == "int4" else 8,
        "type": "float" if scheme.kind == "fp8" else "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group_size,
        "strategy": scheme.strategy,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    activations = None
    if scheme.kind != "int4":
        activations = {
            "num_bits": 8,
            "type": weights["type"],
            "symmetric": True,
            "group_size": None,
            "strategy": "tensor" if scheme.static_input else "token",
            "block_structure": None,
            "dynamic": not scheme.static_input,
            "actorder": None,
            "observer": "minmax" if scheme.static_input else None,
            "observer_kwargs": {},
        }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt[scheme.kind],
        "config_groups": {
            "group_0": {
                "targets": list(scheme.targets),
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
                "format": fmt[scheme.kind],
            }
        },
        "ignore": list(scheme.ignore),
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def compress(weight: torch.Tensor, scheme: CompressedTensorsScheme) -> dict[str, torch.Tensor]:
    """The tensors that stand for one projection's float `weight` [out, in] in the checkpoint,
    by their names' last part (`weight_packed`, `weight_scale`, ...)."""
    if scheme.kind == "fp8":
        q, scale = quantize_fp8(weight, per_channel=scheme.strategy == "channel")
        held = {"weight": q, "weight_scale": scale}
        if scheme.static_input:
            held["input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
        return held
    bits = 4 if scheme.kind == "int4" else 8
    q, scale, zero = quantize_int(weight, bits, scheme.group_size, scheme.symmetric)
    if scheme.kind == "int8":
        return {"weight": q, "weight_scale": scale}
    held = {
        "weight_packed": pack_int4(q),
        "weight_scale": scale,
        "weight_shape": torch.tensor(list(weight.shape)),
    }
    if zero is not None:
        held["weight_zero_point"] = pack_int4(zero, dim=0)
    return held


def write_compressed_tensors_checkpoint(
    src: Path, out_dir: Path, scheme: CompressedTensorsScheme
) -> Path:
    """A copy of the float checkpoint `src` in compressed-tensors' layout for `scheme`: each
    projection it quantizes (q/k/v/o, gate/up/down, less `ignore`) as `compress` writes it, in
    the checkpoint's float dtype for scales; embeddings, norms and lm_head as they were."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and scheme.quantizes(module):
            for kind, held in compress(tensor, scheme).items():
                floating = held.dtype == torch.float32
                written[f"{module}.{kind}"] = held.to(tensor.dtype) if floating else held
        else:
            written[name] = tensor
    save_file(written, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out_dir / path.name)
    return out_dir
