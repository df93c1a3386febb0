"""Writing a float gpt-oss checkpoint in the layout of gpt-oss's releases (MXFP4 experts), for
tests and benchmarks: each layer's `experts.gate_up_proj` and `experts.down_proj` quantized by
the reference (`mxfp4_reference.quantize`) into `_blocks` and `_scales`, the rest copied.

    from pdserve.engine.quant.mxfp4_checkpoint import write_mxfp4_checkpoint
    write_mxfp4_checkpoint(Path("gpt-oss-bf16"), Path("gpt-oss-mxfp4"))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.quant.mxfp4_reference import quantize

# What gpt-oss-20b's and -120b's config.json keep in float.
RELEASE_NOT_CONVERTED = (
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
)
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def write_mxfp4_checkpoint(src: Path, out_dir: Path) -> Path:
    """A copy of the float gpt-oss checkpoint `src` as gpt-oss's releases publish it: each
    expert projection, stored by transformers as [experts, in, out], written as
    `{name}_blocks` uint8 [experts, out, in / 32, 16] and `{name}_scales` uint8 [experts, out,
    in / 32]; biases, attention, router, embeddings and lm_head as they were; config.json's
    quantization_config the releases'."""
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "gpt_oss":
        raise ValueError(
            f"{src} is not a gpt-oss checkpoint (model_type {config.get('model_type')!r})"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(EXPERT_WEIGHTS):
            blocks, scales = quantize(tensor.float().transpose(1, 2))
            written[name + "_blocks"], written[name + "_scales"] = blocks, scales
        else:
            written[name] = tensor
    save_file(written, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": list(RELEASE_NOT_CONVERTED),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json",):
            if path.name != "model.safetensors.index.json" and path.is_file():
                shutil.copy(path, out_dir / path.name)
    return out_dir
