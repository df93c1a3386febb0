"""`pdserve tune` sizes every quantized format's weights as a node holds them: for each format a
tiny checkpoint is written by the format's own writer, loaded, and the bytes its layers hold
(quantized projections with their scales, zero points and group indices, the rest in float32)
must equal `ModelShape.weight_bytes`; a float checkpoint's figure stays parameters x dtype."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from checkpoints import build_checkpoint
from torch import nn

from pdserve.engine.models.loader import load_model
from pdserve.engine.quant.compressed_tensors_checkpoint import (
    PRESETS as CT_PRESETS,
)
from pdserve.engine.quant.compressed_tensors_checkpoint import (
    write_compressed_tensors_checkpoint,
)
from pdserve.engine.quant.mxfp4_checkpoint import write_mxfp4_checkpoint
from pdserve.engine.quant.packed_checkpoint import write_awq_checkpoint, write_gptq_checkpoint
from pdserve.tune.model_shape import ModelShape


def _ct(preset: str, **changes: object):  # noqa: ANN202
    scheme = dataclasses.replace(CT_PRESETS[preset], **changes)
    return lambda src, out: write_compressed_tensors_checkpoint(src, out, scheme)


# name -> (family, writer): every format pdserve loads besides block-scaled FP8 (whose figure
# test_tune_mla and test_quant_fp8 check), each in the layouts that change its bytes.
WRITERS = {
    "awq": ("llama", lambda src, out: write_awq_checkpoint(src, out, group_size=16)),
    "gptq_sym": ("llama", lambda src, out: write_gptq_checkpoint(src, out, group_size=16)),
    "gptq_act_order": (
        "qwen3",
        lambda src, out: write_gptq_checkpoint(src, out, group_size=32, desc_act=True, sym=False),
    ),
    "gptq_8bit_per_output": (
        "llama",
        lambda src, out: write_gptq_checkpoint(src, out, group_size=-1, bits=8, sym=False),
    ),
    "ct_fp8_channel": ("llama", _ct("FP8_DYNAMIC")),
    "ct_int8": ("llama", _ct("W8A8")),
    "ct_w4a16": ("llama", _ct("W4A16", group_size=16)),
    "ct_w4a16_asym": ("qwen3", _ct("W4A16_ASYM", group_size=32)),
    "mxfp4": ("gpt_oss_mxfp4", write_mxfp4_checkpoint),
}


def held_weight_bytes(model: nn.Module) -> int:
    """What the loaded model holds of what the tuner sizes: every matrix (projections, quantized
    layers' packed weights, scales, zero points and group indices, routers, experts, embeddings
    and LM head), each tensor once; biases, norms and attention sinks (vectors) aside."""
    held = {
        id(param): param.nbytes
        for name, param in model.named_parameters(remove_duplicate=False)
        if param.ndim >= 2 and "bias" not in name.rsplit(".", 1)[-1]
    }
    return sum(held.values())


@pytest.fixture(scope="module")
def floats(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.mark.parametrize("name", WRITERS)
def test_the_tuners_weight_bytes_are_what_the_loaded_model_holds(name, floats, tmp_path):
    family, write = WRITERS[name]
    quantized = write(floats(family), tmp_path / name)
    shape = ModelShape.from_model_dir(quantized)
    assert shape.weight_format is not None
    model = load_model(quantized, "float32", "cpu")
    assert shape.weight_bytes("float32") == held_weight_bytes(model)
    # Smaller than the float checkpoint it came from, whose figure is unchanged.
    plain = ModelShape.from_model_dir(floats(family))
    assert plain.weight_format is None
    assert shape.weight_bytes("float32") < plain.weight_bytes("float32")
    assert shape.weights_label("float32").startswith(shape.weight_format.label)
    assert ModelShape.from_dict(shape.to_dict()) == shape


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss_mxfp4"])
def test_a_float_checkpoint_is_sized_at_its_dtype(family, floats):
    shape = ModelShape.from_model_dir(floats(family))
    model = load_model(floats(family), "float32", "cpu")
    assert shape.weight_bytes("float32") == held_weight_bytes(model)
    assert shape.weight_bytes("bfloat16") * 2 == shape.weight_bytes("float32")
