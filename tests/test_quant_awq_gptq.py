"""AWQ and GPTQ checkpoints (AutoAWQ's GEMM layout; AutoGPTQ's and GPTQModel's): tiny float32
checkpoints made by `transformers`, quantized round-to-nearest by our writers of the published
layouts (`pdserve.engine.quant.packed_checkpoint`), served with their weights kept packed.

The references: each format's dequantization (`awq_reference`, `gptq_reference`), checked on
int32 words worked out by hand; the tokens of the same weights dequantized into a float32
checkpoint, run by pdserve and by transformers. transformers runs AWQ and GPTQ checkpoints
themselves only through autoawq or gptqmodel with optimum, which are not installed here (they
need compiled kernels), so the tokens are compared on the dequantized checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import build_checkpoint, dequantize_checkpoint_packed, hf_greedy
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.loader import load_model
from pdserve.engine.quant import awq_reference, gptq_reference
from pdserve.engine.quant.awq_linear import AwqLinear
from pdserve.engine.quant.gptq_linear import GptqLinear
from pdserve.engine.quant.int_packing import AWQ_ORDER, pack, unpack
from pdserve.engine.quant.packed_checkpoint import write_awq_checkpoint, write_gptq_checkpoint
from pdserve.engine.tp.model_shard import weight_line
from pdserve.engine.tp.shard import TPShard
from pdserve.tune.local_server import PdserveServer, PdserveSystem

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = [3, 9, 17, 30]
# name -> (family, writer options): AWQ with and without biases (qwen2: q/k/v biases, tied
# embeddings); GPTQ symmetric in groups, asymmetric in act-order (each projection's inputs
# grouped in an order of its own), and 8-bit asymmetric with one group per output in GPTQModel's
# v2 format.
CHECKPOINTS = {
    "awq": ("llama", dict(format="awq", group_size=16)),
    "awq_qwen2": ("qwen2", dict(format="awq", group_size=32)),
    "gptq_sym": ("llama", dict(format="gptq", group_size=16, sym=True)),
    "gptq_act_order": ("qwen3", dict(format="gptq", group_size=16, desc_act=True, sym=False)),
    "gptq_8bit_per_output_v2": (
        "llama",
        dict(format="gptq", group_size=-1, bits=8, sym=False, checkpoint_format="gptq_v2"),
    ),
}


def write(plain: Path, out: Path, format: str, **options: object) -> Path:
    if format == "awq":
        return write_awq_checkpoint(plain, out, **options)
    return write_gptq_checkpoint(plain, out, **options)


@pytest.fixture(scope="module")
def packed_dirs(tmp_path_factory: pytest.TempPathFactory):
    """name -> (packed checkpoint, its dequantized float32 copy), built once."""
    built: dict[str, tuple[Path, Path]] = {}
    plains: dict[str, Path] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            family, options = CHECKPOINTS[name]
            if family not in plains:
                plains[family] = build_checkpoint(family, tmp_path_factory.mktemp(family))
            root = tmp_path_factory.mktemp(name)
            packed = write(plains[family], root / "packed", **options)
            built[name] = packed, dequantize_checkpoint_packed(packed, root / "dequantized")
        return built[name]

    return get


def greedy(model_dir: Path, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    with LLM(str(model_dir), num_kv_blocks=64, device="cpu", **engine) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def word(value: int) -> int:
    """An unsigned 32-bit word as the int32 a checkpoint stores."""
    return value - 2**32 if value >= 2**31 else value


# --- the layouts and their references, on words worked out by hand -------------------------------


def test_packing_puts_value_i_in_bits_4i_or_in_awqs_interleaved_order():
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    assert pack(values, 4, 1).item() == word(0xF7654321)
    # AWQ: nibbles 0..7 hold values 0, 2, 4, 6, 1, 3, 5, 7.
    assert pack(values, 4, 1, AWQ_ORDER).item() == word(0xF6427531)
    assert torch.equal(unpack(torch.tensor([[word(0xF6427531)]]), 4, 1, AWQ_ORDER), values)
    # Along dim 0 (GPTQ's qweight): a column of eight values is one word.
    assert pack(values.T, 4, 0).tolist() == [[word(0xF7654321)]]
    assert pack(torch.tensor([[1, 2, 3, 255]]), 8, 1).item() == word(0xFF030201)


def test_awq_reference_reads_interleaved_nibbles_zeros_and_group_scales():
    # 2 inputs (one group of 2), 8 outputs. Input 0's word holds outputs 0..7 = 1..8 in AWQ's
    # order; input 1's word is all 15. Zero points 0..7 by output, same order; scales 0.5 but
    # output 7's 2.
    qweight = torch.tensor([[word(0x86427531)], [word(0xFFFFFFFF)]], dtype=torch.int32)
    qzeros = torch.tensor([[word(0x75316420)]], dtype=torch.int32)
    scales = torch.tensor([[0.5] * 7 + [2.0]], dtype=torch.float16)
    expected = torch.tensor(
        [[0.5] * 7 + [2.0], [7.5, 7.0, 6.5, 6.0, 5.5, 5.0, 4.5, 16.0]]
    ).T  # [out, in]
    assert torch.equal(awq_reference.dequantize(qweight, qzeros, scales, 2), expected)


# 8 inputs, 8 outputs, groups of 4. Output 0's word holds inputs 0..7 = 1..8; every other
# output's inputs are all 1. Stored zeros: group 0's word 7 for output 0 (0 for the rest),
# group 1's word all 15. Scales: group 0's output 0 a quarter, the rest one.
GPTQ_QWEIGHT = torch.tensor([[word(0x87654321)] + [0x11111111] * 7], dtype=torch.int32)
GPTQ_QZEROS = torch.tensor([[0x00000007], [word(0xFFFFFFFF)]], dtype=torch.int32)
GPTQ_SCALES = torch.ones(2, 8, dtype=torch.float16)
GPTQ_SCALES[0, 0] = 0.25


def test_gptq_v1_reference_adds_one_to_each_stored_zero():
    g_idx = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    w = gptq_reference.dequantize(GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, g_idx, 4)
    # Output 0: group 0's zero 7 + 1 at scale 1/4, group 1's zero 15 + 1 at scale 1.
    assert w[0].tolist() == [-1.75, -1.5, -1.25, -1.0, -11.0, -10.0, -9.0, -8.0]
    # Output 1: group 0's zero 0 + 1, group 1's 16.
    assert w[1].tolist() == [0.0] * 4 + [-15.0] * 4
    v2 = gptq_reference.dequantize(GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, g_idx, 4, v1=False)
    assert v2[0].tolist() == [-1.5, -1.25, -1.0, -0.75, -10.0, -9.0, -8.0, -7.0]


def test_gptq_reference_groups_each_input_by_its_g_idx_entry():
    g_idx = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0], dtype=torch.int32)  # act-order
    w = gptq_reference.dequantize(GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, g_idx, 4)
    assert w[0].tolist() == [-15.0, -1.5, -13.0, -1.0, -0.75, -10.0, -9.0, 0.0]
    with pytest.raises(ValueError, match="does not index the 2 groups"):
        gptq_reference.dequantize(GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, g_idx + 1, 4)


@pytest.mark.parametrize(
    "bits,group,sym,seed,v1",
    [
        (4, 16, True, None, True),
        (4, 16, False, 3, True),
        (4, -1, False, None, False),
        (8, 32, True, 5, False),
    ],  # fmt: skip (a table of cases)
)
def test_gptq_writer_rounds_each_weight_to_within_half_its_step(bits, group, sym, seed, v1):
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    g_idx = gptq_reference.act_order_groups(64, group, seed)
    qweight, qzeros, scales = gptq_reference.quantize(weight, g_idx, bits, sym, v1)
    assert qweight.shape == (64 * bits // 32, 24) and qzeros.shape == (
        scales.shape[0],
        24 * bits // 32,
    )
    assert scales.dtype == torch.float16 and scales.shape == (1 if group == -1 else 64 // group, 24)
    w = gptq_reference.dequantize(qweight, qzeros, scales, g_idx, bits, v1)
    step = scales.float()[g_idx.long()].T
    # Half a step, and a hair more at a range's clamped end: the scale is rounded to float16
    # (off by up to 2**-11 of it) and that end is up to 2**bits / 2 steps from the zero point.
    assert ((w - weight).abs() <= step * (0.5 + 2**bits / 2**12)).all()
    if seed is not None:
        assert not torch.equal(g_idx, gptq_reference.act_order_groups(64, group))


def test_awq_writer_rounds_each_weight_to_within_half_its_step():
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    qweight, qzeros, scales = awq_reference.quantize(weight, 16)
    assert qweight.shape == (64, 3) and qzeros.shape == (4, 3) and scales.shape == (4, 24)
    w = awq_reference.dequantize(qweight, qzeros, scales, 16)
    step = scales.float().repeat_interleave(16, 0).T
    assert ((w - weight).abs() <= step * (0.5 + 2**4 / 2**12)).all()


@pytest.mark.parametrize(
    "bits,group,desc_act,sym,v1",
    [
        (4, 16, False, False, True),
        (4, 16, True, False, True),
        (4, -1, False, True, True),
        (8, 32, False, False, False),
        (4, 24, False, False, True),
    ],  # fmt: skip (a table of cases)
)
def test_the_gptq_layer_dequantizes_fused_parts_as_the_reference(bits, group, desc_act, sym, v1):
    """Each fused part (q, k, v) by its own g_idx; inputs in order take the layer's broadcast
    path, act-order and one group per output its gather (groups of 24: 64 inputs end ragged)."""
    layer = GptqLinear(64, (16, 8, 8), False, bits, group, desc_act, v1)
    parts = []
    for i, rows in enumerate((16, 8, 8)):
        weight = torch.randn(rows, 64, generator=torch.Generator().manual_seed(i))
        g_idx = gptq_reference.act_order_groups(64, group, i if desc_act else None)
        packed = gptq_reference.quantize(weight, g_idx, bits, sym, v1)
        parts.append((*packed, g_idx))
        layer.g_idx.data[i] = g_idx
    layer.qweight.data = torch.cat([p[0] for p in parts], dim=1)
    layer.qzeros.data = torch.cat([p[1] for p in parts], dim=1)
    layer.scales.data = torch.cat([p[2] for p in parts], dim=1)
    expected = torch.cat([gptq_reference.dequantize(*p[:3], p[3], bits, v1) for p in parts])
    assert torch.equal(layer.dequantized(torch.float32), expected)


def test_the_awq_layer_dequantizes_fused_parts_as_the_reference():
    layer = AwqLinear(64, (16, 8), False, 16)
    parts = [awq_reference.quantize(torch.randn(rows, 64), 16) for rows in (16, 8)]
    for kind, i in (("qweight", 0), ("qzeros", 1), ("scales", 2)):
        getattr(layer, kind).data = torch.cat([p[i] for p in parts], dim=1)
    expected = torch.cat([awq_reference.dequantize(*p, 16) for p in parts])
    assert torch.equal(layer.dequantized(torch.float32), expected)


def test_the_written_checkpoints_hold_the_published_names_dtypes_and_shapes(packed_dirs):
    from safetensors import safe_open

    awq, _ = packed_dirs("awq")
    gptq, _ = packed_dirs("gptq_act_order")
    assert json.loads((awq / "config.json").read_text())["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 16,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    qcfg = json.loads((gptq / "config.json").read_text())["quantization_config"]
    assert qcfg["desc_act"] is True and qcfg["checkpoint_format"] == "gptq"
    with safe_open(str(awq / "model.safetensors"), framework="pt") as f:
        shapes = {n: (f.get_tensor(n).dtype, tuple(f.get_tensor(n).shape)) for n in f.keys()}
    gate = "model.layers.0.mlp.gate_proj."  # 128 outputs of 64 inputs
    assert shapes[gate + "qweight"] == (torch.int32, (64, 16))
    assert shapes[gate + "qzeros"] == (torch.int32, (4, 16))
    assert shapes[gate + "scales"] == (torch.float16, (4, 128))
    assert gate + "weight" not in shapes and shapes["lm_head.weight"][0] == torch.float32
    with safe_open(str(gptq / "model.safetensors"), framework="pt") as f:
        down = "model.layers.1.mlp.down_proj."  # 64 outputs of 128 inputs
        assert tuple(f.get_tensor(down + "qweight").shape) == (16, 64)
        assert tuple(f.get_tensor(down + "qzeros").shape) == (8, 8)
        g_idx = f.get_tensor(down + "g_idx")
    assert g_idx.dtype == torch.int32 and g_idx.shape == (128,)
    assert sorted(g_idx.tolist()) == [i // 16 for i in range(128)]  # 8 groups of 16, shuffled
    assert g_idx.tolist() != sorted(g_idx.tolist())


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_tokens_equal_the_dequantized_model_and_transformers(name, packed_dirs):
    packed, dequantized = packed_dirs(name)
    prompts = random_prompts(5, PROMPT_LENGTHS)
    tokens = greedy(packed, prompts)
    assert tokens == greedy(dequantized, prompts)
    assert tokens == hf_greedy(dequantized, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("name", ["awq", "gptq_act_order"])
def test_tensor_parallel_gives_the_tokens_of_one_rank(name, packed_dirs):
    """With act-order, a row-parallel rank's inputs fall in any group: it holds them all."""
    packed, _ = packed_dirs(name)
    prompts = random_prompts(7, PROMPT_LENGTHS)
    assert greedy(packed, prompts, tensor_parallel_size=2) == greedy(packed, prompts)


def test_a_rank_share_inside_a_group_is_refused_naming_the_sizes(packed_dirs):
    packed, _ = packed_dirs("awq")
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 64  # o_proj's inputs per rank: 32
    config = ModelConfig.from_dict(cfg)
    TPShard(0, 1).check(config)
    with pytest.raises(ValueError) as err:
        TPShard(0, 2).check(config)
    message = str(err.value)
    assert "awq 4-bit gemm, groups of 64" in message and "tensor_parallel_size=2" in message
    assert "columns of o_proj start at 32, inside a block of 64" in message


# --- memory --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,layer_type,label",
    [
        ("awq", AwqLinear, "awq 4-bit gemm, groups of 16"),
        ("gptq_act_order", GptqLinear, "gptq 4-bit asymmetric, groups of 16, act-order"),
    ],
)
def test_quantized_linears_keep_a_quarter_of_bf16_plus_group_scales(
    name, layer_type, label, packed_dirs
):
    packed, dequantized = packed_dirs(name)
    model = load_model(packed, "float32", "cpu")
    layers = [m for m in model.modules() if isinstance(m, layer_type)]
    assert len(layers) == 8  # qkv, o, gate_up and down in each of 2 layers
    weights = sum(m.out_features * m.in_features for m in layers)
    assert sum(m.qweight.nbytes for m in layers) == 2 * weights // 4  # a quarter of bf16
    # Per group of 16 inputs and output: a float16 scale and a 4-bit zero point; GPTQ adds
    # each input's int32 group index, one row per fused part.
    groups = sum(m.out_features * m.in_features // 16 for m in layers)
    g_idx = sum(len(m.out_parts) * m.in_features for m in layers) if name != "awq" else 0
    held = sum(p.nbytes for m in layers for p in m.parameters())
    assert held == 2 * weights // 4 + groups * 2 + groups // 2 + 4 * g_idx
    # GPTQ's group indices are a tiny model's share only: 4 bytes per input, not per weight.
    assert held - 4 * g_idx < 0.33 * 2 * weights
    assert all(m.qweight.dtype == torch.int32 and m.scales.dtype == torch.float16 for m in layers)
    plain = load_model(dequantized, "float32", "cpu")
    saved = sum(p.nbytes for p in plain.parameters()) - sum(p.nbytes for p in model.parameters())
    assert saved == 4 * weights - held
    assert f"in 8 linear layers kept in {label}" in weight_line(model)


def test_a_bfloat16_model_keeps_packed_int32_words_and_float16_scales(packed_dirs):
    packed, _ = packed_dirs("gptq_sym")
    model = load_model(packed, "bfloat16", "cpu")
    layer = model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, GptqLinear)
    assert layer.qweight.dtype == torch.int32 and layer.g_idx.dtype == torch.int32
    assert layer.scales.dtype == torch.float16
    assert model.embed_tokens.weight.dtype == torch.bfloat16


# --- refusals ------------------------------------------------------------------------------------

AWQ_CONFIG = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 128,
    "zero_point": True,
    "version": "gemm",
}
GPTQ_CONFIG = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
}


def llama_config(quantization: dict) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "quantization_config": quantization,
    }


def test_the_published_configs_load():
    # AutoAWQ's own spelling of the fields (w_bit, q_group_size, "GEMM") as well.
    awq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM",
           "zero_point": True, "modules_to_not_convert": ["visual"]}  # fmt: skip
    scheme = ModelConfig.from_dict(llama_config(awq)).quantization
    assert scheme.group_size == 64 and scheme.alignment == (8, 64)
    assert scheme.quantizes("model.layers.0.mlp.down_proj")
    assert not scheme.quantizes("model.visual.blocks.0.mlp.down_proj")
    gptq = {**GPTQ_CONFIG, "desc_act": True, "checkpoint_format": "gptq_v2", "bits": 8}
    scheme = ModelConfig.from_dict(llama_config(gptq)).quantization
    assert (scheme.bits, scheme.desc_act, scheme.v1) == (8, True, False)
    assert scheme.alignment == (4, 4)  # act-order: any input in any group
    assert ModelConfig.from_dict(llama_config(GPTQ_CONFIG)).quantization.alignment == (8, 128)


@pytest.mark.parametrize(
    "base,field,value",
    [
        (AWQ_CONFIG, "bits", 8),
        (AWQ_CONFIG, "bits", 3),
        (AWQ_CONFIG, "version", "gemv"),
        (AWQ_CONFIG, "version", "marlin"),
        (AWQ_CONFIG, "version", "exllama"),
        (AWQ_CONFIG, "zero_point", False),
        (AWQ_CONFIG, "group_size", 0),
        (AWQ_CONFIG, "backend", "llm-awq"),
        (AWQ_CONFIG, "modules_to_not_convert", "visual"),
        (GPTQ_CONFIG, "bits", 2),
        (GPTQ_CONFIG, "bits", 3),
        (GPTQ_CONFIG, "group_size", 0),
        (GPTQ_CONFIG, "desc_act", "yes"),
        (GPTQ_CONFIG, "sym", None),
        (GPTQ_CONFIG, "checkpoint_format", "marlin"),
        (GPTQ_CONFIG, "dynamic", {"-:.*down_proj": {}}),
        (GPTQ_CONFIG, "lm_head", True),
    ],
)
def test_each_unsupported_field_value_is_refused_by_name(base, field, value):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(llama_config({**base, field: value}))
    message = str(err.value)
    assert "\n" not in message
    assert f"config.json field 'quantization_config.{field}' = {value!r} is not supported" in (
        message
    )


def test_a_shuffled_g_idx_under_desc_act_false_is_refused_by_a_rank_naming_the_field(
    packed_dirs, tmp_path
):
    packed, _ = packed_dirs("gptq_act_order")
    lying = tmp_path / "lying"
    lying.mkdir()
    for path in packed.iterdir():
        (lying / path.name).write_bytes(path.read_bytes())
    cfg = json.loads((lying / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = False
    (lying / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"quantization_config.desc_act = true"):
        greedy(lying, [[5, 6]], tensor_parallel_size=2)


# --- served --------------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize(
    "name,label",
    [
        ("gptq_act_order", "gptq 4-bit asymmetric, groups of 16, act-order"),
        ("awq", "awq 4-bit gemm, groups of 16"),
    ],
)
def test_pdserve_serve_disaggregated_gives_the_offline_tokens(packed_dirs, tmp_path, name, label):
    packed, _ = packed_dirs(name)
    prompt = random_prompts(8, [14])[0]
    with LLM(str(packed), num_kv_blocks=64, device="cpu") as llm:
        (out,) = llm.generate([prompt], GREEDY)
        expected = llm.tokenizer.decode(out.token_ids)
    system = PdserveSystem("gptq", prefill_nodes=1, decode_nodes=1, flags=("--insecure",))
    with PdserveServer(system, tmp_path, str(packed)) as server:
        body = {
            "model": httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": GREEDY.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
        logs = "".join(p.read_text() for p in (tmp_path / "gptq").rglob("*.log"))
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == GREEDY.max_tokens
    assert f"linear layers kept in {label}" in logs
