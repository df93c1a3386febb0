"""Hugging Face fine-grained FP8 checkpoints (DeepSeek-V3/R1's and Qwen3-FP8's layout): tiny
float32 checkpoints made by `transformers`, quantized by our writer of the published layout
(`pdserve.engine.quant.fp8_checkpoint`), served with their weights kept in FP8.

The tokens' references: the same weights dequantized into a float32 checkpoint, run by pdserve
and by transformers. transformers (5.x) loads an FP8 checkpoint on a CPU only with `accelerate`
installed (it refuses with an ImportError otherwise), then dequantizes it on load, and only where
every dimension is whole blocks (its dequantizer refuses ragged last blocks); the test that runs
it skips, saying why, where it cannot.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import build_checkpoint, dequantize_checkpoint_fp8, hf_greedy
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.loader import load_model
from pdserve.engine.quant.fp8_checkpoint import write_fp8_checkpoint
from pdserve.engine.quant.fp8_linear import Fp8Linear
from pdserve.engine.quant.fp8_reference import FP8, dequantize, quantize, scale_shape
from pdserve.engine.tp.model_shard import weight_line
from pdserve.engine.tp.shard import TPShard
from pdserve.tune.local_server import PdserveServer, PdserveSystem

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = [3, 9, 17, 30]
# family -> weight_block_size: llama_fp8's hidden size (72) ends in a ragged block of 16 while
# its tensor-parallel shares are whole blocks; qwen3_fp8's MLP width (88) ends in a ragged block
# of 32, so its fused gate/up parts' scale rows do not line up with one block grid.
SHAPES = {"llama_fp8": (16, 16), "qwen3_fp8": (32, 32)}


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory):
    """family -> (FP8 checkpoint, its dequantized float32 copy), built once."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            plain = build_checkpoint(family, root / "float32")
            fp8 = write_fp8_checkpoint(plain, root / "fp8", SHAPES[family])
            built[family] = fp8, dequantize_checkpoint_fp8(fp8, root / "dequantized")
        return built[family]

    return get


def greedy(model_dir: Path, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    with LLM(str(model_dir), num_kv_blocks=64, device="cpu", **engine) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# --- the layout and its reference --------------------------------------------------------------


def test_reference_dequantizes_each_block_by_its_own_scale():
    # A 4x6 weight in 2x2 blocks: a 2x3 grid of scales set by hand.
    weight = torch.tensor(
        [[1, 2, 0.5, -1, 4, 8], [-2, 1, 1, 1, 0.25, 1], [3, 1, -1, 2, 1, 1], [1, 1, 1, 1, -6, 1]]
    ).to(FP8)
    scales = torch.tensor([[1.0, 2.0, 0.5], [10.0, -1.0, 0.125]])
    expected = torch.tensor(
        [
            [1, 2, 1, -2, 2, 4],
            [-2, 1, 2, 2, 0.125, 0.5],
            [30, 10, 1, -2, 0.125, 0.125],
            [10, 10, -1, -1, -0.75, 0.125],
        ]
    )
    assert torch.equal(dequantize(weight, scales, (2, 2)), expected)


def test_reference_reads_ragged_last_blocks():
    # 3x5 in 2x2 blocks: the last row block holds one row, the last column block one column.
    weight = torch.ones(3, 5).to(FP8)
    scales = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert scale_shape((3, 5), (2, 2)) == (2, 3)
    out = dequantize(weight, scales, (2, 2))
    assert out[2].tolist() == [4, 4, 5, 5, 6]
    assert out[:, 4].tolist() == [3, 3, 6]
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        dequantize(weight, scales[:, :2], (2, 2))


def test_writer_scales_each_block_to_fp8s_largest_value():
    weight = torch.zeros(3, 5)
    weight[0, 0], weight[1, 1] = 448.0 * 3, -1.5  # block (0, 0): amax 1344
    weight[2, 4] = 0.5  # block (1, 2), ragged both ways
    q, scale_inv = quantize(weight, (2, 2))
    assert q.dtype == FP8 and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (2, 3)
    assert scale_inv[0, 0] == 3.0 and scale_inv[1, 2] == 0.5 / 448
    assert scale_inv[0, 1] == 1.0  # an all-zero block keeps scale one
    assert q.float()[0, 0] == 448.0 and q.float()[2, 4] == 448.0
    assert torch.equal(dequantize(q, scale_inv, (2, 2))[[0, 2], [0, 4]], torch.tensor([1344, 0.5]))
    big = torch.randn(40, 72)
    q, scale_inv = quantize(big, (16, 16))
    assert torch.allclose(dequantize(q, scale_inv, (16, 16)), big, rtol=2**-3, atol=1e-3)


def test_the_written_checkpoint_holds_the_published_names_dtypes_and_shapes(fp8_dirs):
    from safetensors import safe_open

    fp8, _ = fp8_dirs("llama_fp8")
    qcfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert qcfg == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
    }
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        gate = f.get_tensor("model.layers.0.mlp.gate_proj.weight")
        gate_scale = f.get_tensor("model.layers.0.mlp.gate_proj.weight_scale_inv")
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert gate.dtype == FP8 and gate.shape == (96, 72)
    assert gate_scale.dtype == torch.float32 and gate_scale.shape == (6, 5)  # 72 = 4 * 16 + 8
    assert "model.embed_tokens.weight_scale_inv" not in names
    assert sum(n.endswith("weight_scale_inv") for n in names) == 2 * 7


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(SHAPES))
def test_fp8_greedy_tokens_equal_the_dequantized_model_and_transformers(family, fp8_dirs):
    fp8, dequantized = fp8_dirs(family)
    prompts = random_prompts(5, PROMPT_LENGTHS)
    tokens = greedy(fp8, prompts)
    assert tokens == greedy(dequantized, prompts)
    assert tokens == hf_greedy(dequantized, prompts, GREEDY.max_tokens)


def test_fp8_greedy_tokens_equal_transformers_on_the_same_fp8_checkpoint(tmp_path):
    """Where transformers loads FP8 on a CPU (accelerate installed; whole blocks only)."""
    pytest.importorskip(
        "accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed"
    )
    plain = build_checkpoint("llama", tmp_path / "float32")  # 64 and 128 wide: whole blocks
    fp8 = write_fp8_checkpoint(plain, tmp_path / "fp8", (16, 16))
    prompts = random_prompts(6, PROMPT_LENGTHS)
    assert greedy(fp8, prompts) == hf_greedy(fp8, prompts, GREEDY.max_tokens)


def test_tensor_parallel_fp8_gives_the_tokens_of_one_rank(fp8_dirs):
    fp8, _ = fp8_dirs("llama_fp8")
    prompts = random_prompts(7, PROMPT_LENGTHS)
    assert greedy(fp8, prompts, tensor_parallel_size=2) == greedy(fp8, prompts)


def test_a_rank_share_inside_a_block_is_refused_naming_the_sizes(fp8_dirs, tmp_path):
    fp8, _ = fp8_dirs("llama_fp8")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [32, 32]  # KV rows per rank: 16
    config = ModelConfig.from_dict(cfg)
    TPShard(0, 1).check(config)
    with pytest.raises(ValueError) as err:
        TPShard(0, 2).check(config)
    message = str(err.value)
    assert "blocks of 32x32" in message and "tensor_parallel_size=2" in message
    assert "k_proj and v_proj start at 16, inside a block of 32" in message


# --- memory --------------------------------------------------------------------------------------


def test_quantized_linears_keep_fp8_weights_and_float32_block_scales(fp8_dirs):
    fp8, dequantized = fp8_dirs("qwen3_fp8")
    model = load_model(fp8, "float32", "cpu")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 8  # qkv, o, gate_up and down in each of 2 layers
    # Per layer, rows and columns: q/k/v 64 + 32 + 32 rows of 64 (scale rows 2 + 1 + 1, of 2
    # columns); o 64x64 (2x2); gate and up 88 rows each (3 + 3 scale rows) of 64; down 64x88
    # (2x3).
    fp8_bytes = 128 * 64 + 64 * 64 + 176 * 64 + 64 * 88
    scale_bytes = 4 * (4 * 2 + 2 * 2 + 6 * 2 + 2 * 3)
    assert sum(p.nbytes for m in layers for p in m.parameters()) == 2 * (fp8_bytes + scale_bytes)
    assert all(m.weight.dtype == FP8 for m in layers)
    bf16_bytes = 2 * 2 * fp8_bytes
    assert 2 * (fp8_bytes + scale_bytes) < 0.52 * bf16_bytes
    # The whole model: the plain copy's linears at 4 bytes a weight, these at 1 plus scales.
    plain = load_model(dequantized, "float32", "cpu")
    plain_bytes = sum(p.nbytes for p in plain.parameters())
    fp8_model_bytes = sum(p.nbytes for p in model.parameters())
    assert plain_bytes - fp8_model_bytes == 2 * (3 * fp8_bytes - scale_bytes)
    assert "in 8 linear layers kept in fp8 e4m3, blocks of 32x32" in weight_line(model)


def test_a_bfloat16_model_keeps_its_fp8_weights_and_float32_scales(fp8_dirs):
    fp8, _ = fp8_dirs("llama_fp8")
    model = load_model(fp8, "bfloat16", "cpu")
    layer = model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, Fp8Linear)
    assert layer.weight.dtype == FP8 and layer.weight_scale_inv.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16


# --- refusals ------------------------------------------------------------------------------------

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def llama_config(**quantization: object) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "quantization_config": {**FP8_CONFIG, **quantization},
    }


def test_the_published_fp8_config_loads():
    cfg = ModelConfig.from_dict(llama_config(modules_to_not_convert=["lm_head"]))
    assert cfg.quantization.block == (128, 128)
    assert cfg.quantization.quantizes("model.layers.0.mlp.down_proj")
    assert not cfg.quantization.quantizes("lm_head")


@pytest.mark.parametrize(
    "field,value",
    [
        ("quant_method", "bitsandbytes"),
        ("fmt", "e5m2"),
        ("activation_scheme", "static"),
        ("weight_block_size", [128]),
        ("weight_block_size", None),
        ("weight_block_size", [0, 128]),
        ("modules_to_not_convert", "lm_head"),
    ],
)
def test_each_unsupported_field_value_is_refused_by_name(field, value):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(llama_config(**{field: value}))
    message = str(err.value)
    assert "\n" not in message
    assert f"config.json field 'quantization_config.{field}' = {value!r} is not supported" in (
        message
    )


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next"])
def test_fp8_in_a_family_without_quantized_layers_is_refused_naming_the_model_type(model_type):
    cfg = {
        **llama_config(),
        "model_type": model_type,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    with pytest.raises(ValueError, match=f"model_type '{model_type}' yet"):
        ModelConfig.from_dict(cfg)


def test_a_fused_projection_half_unquantized_is_refused():
    cfg = ModelConfig.from_dict(llama_config(modules_to_not_convert=["self_attn.k_proj"]))
    with pytest.raises(ValueError, match="k_proj.*pdserve fuses them"):
        load_model_from_config(cfg)


def load_model_from_config(cfg: ModelConfig) -> None:
    from pdserve.engine.models.loader import build_model

    build_model(cfg, "float32", "cpu")


# --- served --------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_pdserve_serve_disaggregated_gives_the_offline_fp8_tokens(fp8_dirs, tmp_path):
    fp8, _ = fp8_dirs("llama_fp8")
    prompt = random_prompts(8, [14])[0]
    with LLM(str(fp8), num_kv_blocks=64, device="cpu") as llm:
        (out,) = llm.generate([prompt], GREEDY)
        expected = llm.tokenizer.decode(out.token_ids)
    system = PdserveSystem("fp8", prefill_nodes=1, decode_nodes=1, flags=("--insecure",))
    with PdserveServer(system, tmp_path, str(fp8)) as server:
        body = {
            "model": httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": GREEDY.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
        logs = "".join(p.read_text() for p in (tmp_path / "fp8").rglob("*.log"))
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == GREEDY.max_tokens
    assert "linear layers kept in fp8 e4m3, blocks of 16x16" in logs


@pytest.mark.parametrize(
    "qcfg",
    [
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
        },
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    ],
    ids=["awq", "gptq"],
)
def test_a_format_without_quantized_experts_is_refused_in_a_mixture_of_experts(qcfg):
    """The 4-bit formats keep linear layers only: a mixture of experts in them is refused naming
    the field, not loaded with float experts read from packed tensors."""
    cfg = {
        **llama_config(),
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "quantization_config": qcfg,
    }
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(cfg)
    message = str(err.value)
    assert f"'quantization_config.quant_method' = {qcfg['quant_method']!r}" in message
    assert "model_type 'qwen3_moe'" in message and "\n" not in message
