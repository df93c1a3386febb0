"""compressed-tensors checkpoints (llm-compressor's layout): FP8 per tensor (static activations)
and per channel (dynamic), INT8 W8A8, and 4-bit W4A16 `pack-quantized` with and without zero
points. Tiny float32 checkpoints made by `transformers`, quantized by our writer of the published
layout (`pdserve.engine.quant.compressed_tensors_checkpoint`), served with their weights kept
quantized.

The tokens' references: transformers running the same quantized checkpoint on the CPU (it needs
the `compressed-tensors` package, a dev dependency), decompressed on load
(`CompressedTensorsConfig(dequantize=True)`, the old `run_compressed=False`: activations are not
quantized, the static `input_scale` is dropped), and pdserve on the weights dequantized by our
reference into a float32 checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import (
    build_checkpoint,
    dequantize_checkpoint_compressed_tensors,
    hf_model_greedy,
)
from conftest import random_prompts
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.loader import load_model
from pdserve.engine.models.weights import CheckpointTensor
from pdserve.engine.quant.compressed_tensors_checkpoint import (
    PRESETS,
    compress,
    quantization_config,
    write_compressed_tensors_checkpoint,
)
from pdserve.engine.quant.compressed_tensors_linear import PackedInt4Linear, ScaledInt8Fp8Linear
from pdserve.engine.quant.compressed_tensors_reference import (
    FP8,
    dequantize,
    pack_int4,
    quantize_int,
    unpack_int4,
)
from pdserve.engine.tp.model_shard import weight_line
from pdserve.engine.tp.shard import TPShard
from pdserve.tune.local_server import PdserveServer, PdserveSystem

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = [3, 9, 17, 30]
# name -> (family, scheme): the tiny models are 64 and 128 wide, so groups of 16 (32 for Qwen3).
SCHEMES = {
    "fp8-channel": ("llama", PRESETS["FP8_DYNAMIC"]),
    "fp8-tensor-static": ("qwen3", PRESETS["FP8"]),
    "int8": ("llama", PRESETS["W8A8"]),
    "w4a16": ("llama", dataclasses.replace(PRESETS["W4A16"], group_size=16)),
    "w4a16-asym": ("qwen3", dataclasses.replace(PRESETS["W4A16_ASYM"], group_size=32)),
    "w4a16-channel-asym": (
        "llama",
        dataclasses.replace(PRESETS["W4A16_ASYM"], strategy="channel", group_size=None),
    ),
}


@pytest.fixture(scope="module")
def ct_dirs(tmp_path_factory: pytest.TempPathFactory):
    """name -> (compressed-tensors checkpoint, its dequantized float32 copy), built once."""
    floats: dict[str, Path] = {}
    built: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            family, scheme = SCHEMES[name]
            if family not in floats:
                floats[family] = build_checkpoint(family, tmp_path_factory.mktemp(family))
            root = tmp_path_factory.mktemp(name)
            quantized = write_compressed_tensors_checkpoint(floats[family], root / "ct", scheme)
            dequantized = dequantize_checkpoint_compressed_tensors(quantized, root / "float32")
            built[name] = quantized, dequantized
        return built[name]

    return get


def greedy(model_dir: Path, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    with LLM(str(model_dir), num_kv_blocks=64, device="cpu", **engine) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def checkpoint_tensors(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """The tensors as the loader hands them to a layer: written, then opened unread."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "t.safetensors"))
    handle = safe_open(str(tmp_path / "t.safetensors"), framework="pt")
    return {name: CheckpointTensor(handle, name, torch.float32) for name in tensors}


# --- the layout and its reference --------------------------------------------------------------

# Two rows of eight 4-bit values and their words, worked out by hand: each value plus 8 is a
# nibble, the first in the lowest bits. Row 0's nibbles 9 0 15 8 7 10 11 5 read high to low are
# 0x5BA78F09; row 1's top nibble is 15, so its word is a negative int32.
VALUES = torch.tensor([[1, -8, 7, 0, -1, 2, 3, -3], [0, 0, 0, 0, 0, 0, 0, 7]], dtype=torch.int8)
WORDS = torch.tensor([[0x5BA78F09], [0xF8888888 - 2**32]], dtype=torch.int32)
# Groups of four columns; zero points [[1, -1], [0, 2]] packed along the rows: column 0's
# nibbles 9 and 8 make 0x89, column 1's 7 and 10 make 0xA7.
SCALES = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
ZEROS = torch.tensor([[1, -1], [0, 2]], dtype=torch.int8)
ZERO_WORDS = torch.tensor([[0x89, 0xA7]], dtype=torch.int32)
# (q - zero) * scale per group: row 0 [0, -9, 6, -1] * 0.5 and [0, 3, 4, -2] * 2; row 1 zeros
# and [-2, -2, -2, 5] * 0.25.
EXPECTED = torch.tensor([[0, -4.5, 3, -0.5, 0, 6, 8, -4], [0, 0, 0, 0, -0.5, -0.5, -0.5, 1.25]])


def test_four_bit_values_pack_eight_to_a_word_low_bits_first_offset_by_eight():
    assert torch.equal(pack_int4(VALUES), WORDS)
    assert torch.equal(unpack_int4(WORDS, 8), VALUES)
    assert torch.equal(pack_int4(ZEROS, dim=0), ZERO_WORDS)
    assert torch.equal(unpack_int4(ZERO_WORDS, 2, dim=0), ZEROS)
    # Ten values take two words, the second padded with zero nibbles past its two values.
    ten = torch.arange(-5, 5, dtype=torch.int8).view(1, 10)
    packed = pack_int4(ten)
    assert packed.shape == (1, 2) and packed[0, 1] == (3 + 8) | (4 + 8) << 4
    assert torch.equal(unpack_int4(packed, 10), ten)


def test_reference_dequantizes_each_group_less_its_zero_point_times_its_scale():
    assert torch.equal(dequantize(VALUES, SCALES, ZEROS), EXPECTED)
    # Per channel ([out, 1]) and per tensor ([1]): FP8 and INT8's scales.
    q = torch.tensor([[2.0, -1.0], [0.5, 4.0]]).to(FP8)
    assert dequantize(q, torch.tensor([[2.0], [0.5]])).tolist() == [[4, -2], [0.25, 2]]
    assert dequantize(q, torch.tensor([3.0])).tolist() == [[6, -3], [1.5, 12]]
    with pytest.raises(ValueError, match="groups dividing 8"):
        dequantize(VALUES, torch.ones(2, 3))


def test_the_packed_layer_dequantizes_the_hand_packed_words(tmp_path):
    scheme = dataclasses.replace(PRESETS["W4A16_ASYM"], group_size=4)
    layer = PackedInt4Linear(8, (2,), False, scheme, None)
    held = {
        "weight_packed": WORDS,
        "weight_scale": SCALES,
        "weight_zero_point": ZERO_WORDS,
        "weight_shape": torch.tensor([2, 8]),
    }
    for kind, tensor in checkpoint_tensors(tmp_path, held).items():
        layer.load(kind, tensor, 0, range(2), 2, 0)
    assert torch.equal(layer.dequantized(torch.float32), EXPECTED)
    assert layer.weight_packed.dtype == torch.int32 and layer.weight_packed.shape == (2, 1)


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_the_gpu_kernel_reads_the_layer_as_it_is_kept(preset, tmp_path):
    """What a GPU layer hands Triton's W4A16 GEMM (`kernel_operands`) multiplies like the layer's
    own dequantization: checked through the kernel's torch reference, so without a GPU."""
    from pdserve.kernels.w4a16_ref import w4a16_matmul_ref

    torch.manual_seed(0)
    scheme = dataclasses.replace(PRESETS[preset], group_size=8)
    float_weight = torch.randn(6, 24)
    packed = compress(float_weight, scheme)
    layer = PackedInt4Linear(24, (6,), False, scheme, None)
    for kind, tensor in checkpoint_tensors(tmp_path, packed).items():
        layer.load(kind, tensor, 0, range(6), 6, 0)
    x = torch.randn(3, 24)
    expected = x @ layer.dequantized(torch.float32).T
    torch.testing.assert_close(w4a16_matmul_ref(x, *layer.kernel_operands(torch.float32)), expected)


def test_fused_fp8_parts_keep_their_own_tensor_scales_stored_as_one_value_or_a_scalar(tmp_path):
    layer = ScaledInt8Fp8Linear(2, (1, 2), False, PRESETS["FP8"], None)  # e.g. q and k of a qkv
    q = {"weight": torch.tensor([[1.0, -2.0]]).to(FP8), "weight_scale": torch.tensor([0.5])}
    k = {
        "weight": torch.tensor([[4.0, 1.0], [2.0, 8.0]]).to(FP8),
        "weight_scale": torch.tensor(3.0),
    }
    for offset, held in ((0, q), (1, k)):
        tensors = checkpoint_tensors(tmp_path / str(offset), held)
        rows = range(len(held["weight"]))
        for kind, tensor in tensors.items():
            layer.load(kind, tensor, 0, rows, len(rows), offset)
    assert layer.dequantized(torch.float32).tolist() == [[0.5, -1], [12, 3], [6, 24]]


def test_the_layout_is_compressed_tensors_own():
    """Our packing and dequantization against the package's own compressor, where it is
    installed (a dev dependency)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig

    values = torch.randint(-8, 8, (24, 44), dtype=torch.int8)
    for dim in (0, 1):
        assert torch.equal(pack_int4(values, dim), pack_to_int32(values, 4, packed_dim=dim))
    scheme = dataclasses.replace(PRESETS["W4A16_ASYM"], group_size=16)
    config = QuantizationConfig.model_validate(quantization_config(scheme))
    weight = torch.randn(24, 64)
    q, scale, zero = quantize_int(weight, 4, 16, symmetric=False)
    held = {
        "weight_packed": pack_int4(q),
        "weight_scale": scale,
        "weight_zero_point": pack_int4(zero, dim=0),
        "weight_shape": torch.tensor([24, 64]),
    }
    theirs = PackedQuantizationCompressor.decompress(held, config.config_groups["group_0"])
    assert torch.equal(theirs["weight"], dequantize(q, scale, zero))


def test_the_written_checkpoint_holds_the_published_names_dtypes_and_shapes(ct_dirs):
    ct, _ = ct_dirs("w4a16-asym")  # qwen3: down_proj 64 rows of 128 columns
    qcfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    assert qcfg["ignore"] == ["lm_head"]
    weights = qcfg["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"]) == (4, "group", 32)
    with safe_open(str(ct / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        down = {k: f.get_tensor(f"model.layers.0.mlp.down_proj.{k}") for k in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}  # fmt: skip
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert down["weight_packed"].dtype == torch.int32 and down["weight_packed"].shape == (64, 16)
    assert down["weight_scale"].shape == (64, 4)  # 128 columns in groups of 32
    assert down["weight_zero_point"].dtype == torch.int32
    assert down["weight_zero_point"].shape == (8, 4)  # 64 rows, eight to a word
    assert down["weight_shape"].tolist() == [64, 128]
    assert "model.layers.0.mlp.down_proj.weight" not in names
    assert sum(n.endswith("weight_packed") for n in names) == 2 * 7


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMES))
def test_greedy_tokens_equal_the_dequantized_model(name, ct_dirs):
    ct, dequantized = ct_dirs(name)
    prompts = random_prompts(5, PROMPT_LENGTHS)
    assert greedy(ct, prompts) == greedy(dequantized, prompts)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_greedy_tokens_equal_transformers_on_the_same_checkpoint(name, ct_dirs):
    pytest.importorskip(
        "compressed_tensors", reason="transformers loads compressed-tensors with the package"
    )
    import transformers

    ct, _ = ct_dirs(name)
    prompts = random_prompts(6, PROMPT_LENGTHS)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ct,
        dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
    )
    assert greedy(ct, prompts) == hf_model_greedy(model, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("name", ["w4a16-asym", "fp8-channel"])
def test_tensor_parallel_gives_the_tokens_of_one_rank(name, ct_dirs):
    ct, _ = ct_dirs(name)
    prompts = random_prompts(7, PROMPT_LENGTHS)
    assert greedy(ct, prompts, tensor_parallel_size=2) == greedy(ct, prompts)


def test_a_rank_share_inside_a_group_is_refused_naming_the_sizes(ct_dirs):
    ct, _ = ct_dirs("w4a16")
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    config = ModelConfig.from_dict(cfg)
    TPShard(0, 1).check(config)
    with pytest.raises(ValueError) as err:
        TPShard(0, 2).check(config)
    message = str(err.value)
    assert "groups of 64" in message and "tensor_parallel_size=2" in message
    assert "rank 1's columns of o_proj start at 32, inside a block of 64" in message


# --- memory --------------------------------------------------------------------------------------


def test_w4a16_layers_keep_half_a_byte_a_weight_plus_their_group_scales(tmp_path):
    plain = build_checkpoint("llama", tmp_path / "float32")
    scheme = dataclasses.replace(PRESETS["W4A16"], group_size=64)
    ct = write_compressed_tensors_checkpoint(plain, tmp_path / "ct", scheme)
    model = load_model(ct, "bfloat16", "cpu")
    layers = [m for m in model.modules() if isinstance(m, PackedInt4Linear)]
    assert len(layers) == 8  # qkv, o, gate_up and down in each of 2 layers
    # Per layer [out, in]: q/k/v 64 + 16 + 16 rows of 64; o 64x64; gate/up 256x64; down 64x128.
    weights = 96 * 64 + 64 * 64 + 256 * 64 + 64 * 128
    scales = 96 * 1 + 64 * 1 + 256 * 1 + 64 * 2  # float32, one per 64 columns
    assert sum(p.nbytes for m in layers for p in m.parameters()) == 2 * (weights // 2 + 4 * scales)
    assert all(m.weight_packed.dtype == torch.int32 for m in layers)
    bf16 = 2 * 2 * weights
    assert 2 * (weights // 2 + 4 * scales) < 0.29 * bf16  # a quarter, plus 1/32 for scales
    assert (
        "in 8 linear layers kept in compressed-tensors int4 (packed), scales per groups of 64"
        in (weight_line(model))
    )


def test_eight_bit_layers_keep_one_byte_a_weight_in_their_stored_dtype(ct_dirs):
    for name, dtype in (("int8", torch.int8), ("fp8-tensor-static", FP8)):
        model = load_model(ct_dirs(name)[0], "bfloat16", "cpu")
        layer = model.layers[0].mlp.gate_up_proj
        assert isinstance(layer, ScaledInt8Fp8Linear)
        assert layer.weight.dtype == dtype and layer.weight_scale.dtype == torch.float32
        assert layer.weight_scale.shape == (layer.out_features, 1)


# --- refusals ------------------------------------------------------------------------------------


def llama_config(qcfg: dict) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "quantization_config": qcfg,
    }


def test_the_published_configs_load():
    for preset in PRESETS.values():
        cfg = ModelConfig.from_dict(llama_config(quantization_config(preset)))
        assert cfg.quantization == preset
        assert cfg.quantization.quantizes("model.layers.0.mlp.down_proj")
        assert not cfg.quantization.quantizes("lm_head")
    regex = quantization_config(PRESETS["W4A16"])
    regex["ignore"] = ["lm_head", "re:.*mlp\\.down_proj$"]
    scheme = ModelConfig.from_dict(llama_config(regex)).quantization
    assert not scheme.quantizes("model.layers.3.mlp.down_proj")
    assert scheme.quantizes("model.layers.3.mlp.up_proj")


def _w4a16(**changes: object) -> dict:
    qcfg = quantization_config(PRESETS["W4A16"])
    group = qcfg["config_groups"]["group_0"]
    for path, value in changes.items():
        where, _, field = path.rpartition("__")
        target = {"": qcfg, "group": group, "weights": group["weights"]}[where]
        target[field] = value
    return qcfg


W = "config_groups.group_0.weights"


@pytest.mark.parametrize(
    "qcfg,field,value",
    [
        (_w4a16(weights__num_bits=3), f"{W}.num_bits", 3),
        (_w4a16(weights__type="float", weights__num_bits=4), f"{W}.num_bits", 4),
        (_w4a16(weights__strategy="block"), f"{W}.strategy", "block"),
        (_w4a16(weights__strategy="tensor"), f"{W}.strategy", "tensor"),
        (_w4a16(weights__actorder="group"), f"{W}.actorder", "group"),
        (_w4a16(weights__dynamic=True), f"{W}.dynamic", True),
        (_w4a16(weights__group_size=None), f"{W}.group_size", None),
        (_w4a16(format="marlin-24", group__format=None), "format", "marlin-24"),
        (_w4a16(group__format="int-quantized"), "config_groups.group_0.format", "int-quantized"),
        (_w4a16(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config",
         {"format": "sparse-24-bitmask"}),
        (_w4a16(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme",
         {"num_bits": 8, "type": "float"}),
        (_w4a16(ignore=[]), "ignore", []),
        (_w4a16(group__targets=["Embedding"]), "config_groups.group_0.targets", ["Embedding"]),
        (_w4a16(group__input_activations={"num_bits": 8, "type": "int"}),
         "config_groups.group_0.input_activations", {"num_bits": 8, "type": "int"}),
    ],
)  # fmt: skip
def test_each_unsupported_field_value_is_refused_by_name(qcfg, field, value):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(llama_config(qcfg))
    message = str(err.value)
    assert "\n" not in message
    assert f"config.json field 'quantization_config.{field}' = {value!r} is not supported" in (
        message
    )


def test_kv_cache_scheme_refusal_points_at_the_flag_and_int8_needs_its_activations():
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ModelConfig.from_dict(llama_config(_w4a16(kv_cache_scheme={"num_bits": 8})))
    int8 = quantization_config(PRESETS["W8A8"])
    int8["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(
        ValueError, match=r"input_activations.strategy' = 'token \(dynamic False\)'"
    ):
        ModelConfig.from_dict(llama_config(int8))


def test_groups_with_different_schemes_are_refused_and_equal_ones_merge():
    qcfg = quantization_config(PRESETS["W4A16"])
    other = json.loads(json.dumps(qcfg["config_groups"]["group_0"]))
    other["targets"] = ["re:.*mlp.*"]
    qcfg["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    qcfg["config_groups"]["group_1"] = other
    scheme = ModelConfig.from_dict(llama_config(qcfg)).quantization
    assert scheme.quantizes("model.layers.0.self_attn.o_proj")
    assert scheme.quantizes("model.layers.0.mlp.up_proj")
    other["weights"]["group_size"] = 64
    with pytest.raises(ValueError, match="'quantization_config.config_groups.group_1'"):
        ModelConfig.from_dict(llama_config(qcfg))


# --- served --------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_pdserve_serve_disaggregated_gives_the_offline_w4a16_tokens(ct_dirs, tmp_path):
    ct, _ = ct_dirs("w4a16")
    prompt = random_prompts(8, [14])[0]
    with LLM(str(ct), num_kv_blocks=64, device="cpu") as llm:
        (out,) = llm.generate([prompt], GREEDY)
        expected = llm.tokenizer.decode(out.token_ids)
    system = PdserveSystem("w4a16", prefill_nodes=1, decode_nodes=1, flags=("--insecure",))
    with PdserveServer(system, tmp_path, str(ct)) as server:
        body = {
            "model": httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": GREEDY.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
        logs = "".join(p.read_text() for p in (tmp_path / "w4a16").rglob("*.log"))
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == GREEDY.max_tokens
    assert "kept in compressed-tensors int4 (packed), scales per groups of 16" in logs
