"""Writing a float checkpoint in Hugging Face's fine-grained FP8 layout (what DeepSeek-V3 and the
Qwen3 `-FP8` releases publish), for tests and benchmarks: each linear projection (attention's,
latent attention's, the MLPs', every expert's and shared expert's) quantized by the reference
(`fp8_reference.quantize`), the rest (embeddings, norms, lm_head, routers) copied.

    from pdserve.engine.quant.fp8_checkpoint import write_fp8_checkpoint
    write_fp8_checkpoint(Path("bf16-model"), Path("fp8-model"), (128, 128))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.quant.fp8_reference import quantize
from pdserve.engine.quant.scheme import QUANTIZABLE_PROJECTIONS


def write_fp8_checkpoint(
    src: Path, out_dir: Path, block: tuple[int, int], not_converted: tuple[str, ...] = ()
) -> Path:
    """A copy of the float checkpoint `src` in Hugging Face's fine-grained FP8 layout (what
    DeepSeek-V3 and Qwen3-FP8 publish): each projection's (`QUANTIZABLE_PROJECTIONS`, experts
    included) `weight` as float8_e4m3fn
    and its `weight_scale_inv` [ceil(out / block[0]), ceil(in / block[1])] float32, and
    config.json's quantization_config; embeddings, norms and lm_head as they were."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        projection = module.rsplit(".", 1)[-1]
        if (
            name.endswith(".weight")
            and projection in QUANTIZABLE_PROJECTIONS
            and not any(n in module for n in not_converted)
        ):
            quantized[name], quantized[module + ".weight_scale_inv"] = quantize(
                tensor.float(), block
            )
        else:
            quantized[name] = tensor
    save_file(quantized, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"modules_to_not_convert": list(not_converted)} if not_converted else {}),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json",):
            shutil.copy(path, out_dir / path.name)
    return out_dir
