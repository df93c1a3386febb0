"""Block-scaled FP8 in experts and latent attention (DeepSeek-V3/R1's published layout, and the
Mixtral and Qwen3-MoE kin whose experts go through the same stacked path): tiny float32
checkpoints made by `transformers`, written FP8 by our writer of the published layout
(`pdserve.engine.quant.fp8_checkpoint`), served with their attention projections, dense MLPs,
shared experts and routed experts kept in FP8.

The tokens' references: the same weights dequantized into a float32 checkpoint, run by pdserve
and by transformers (which runs no FP8 experts on a CPU); and one served 1P+1D cluster."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import build_checkpoint, dequantize_checkpoint_fp8, hf_greedy
from conftest import random_prompts
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.loader import load_model
from pdserve.engine.quant.fp8_checkpoint import write_fp8_checkpoint
from pdserve.engine.quant.fp8_experts import Fp8Experts
from pdserve.engine.quant.fp8_linear import Fp8Linear
from pdserve.engine.quant.fp8_reference import FP8, dequantize
from pdserve.engine.tp.model_shard import weight_line
from pdserve.engine.tp.shard import TPShard
from pdserve.tune.local_server import PdserveServer, PdserveSystem

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = [3, 11, 26]
# family -> weight_block_size. DeepSeek-V3 in blocks of 16: every tensor-parallel share (of 2)
# is whole blocks, kv_a_proj_with_mqa's 40 rows end in a ragged block. V2-Lite's shape (q_proj
# straight from the hidden state, YaRN) in blocks of 8. Qwen3-MoE in blocks of 32: its experts'
# width (48) ends in a ragged block, so the stacked gate and up parts each keep their own scale
# rows. Mixtral's experts are w1/w3/w2.
BLOCKS = {
    "deepseek_v3": (16, 16),
    "deepseek_v2": (8, 8),
    "qwen3_moe": (32, 32),
    "mixtral": (32, 32),
}


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory):
    """family -> (FP8 checkpoint, its dequantized float32 copy), built once."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            plain = build_checkpoint(family, root / "float32")
            fp8 = write_fp8_checkpoint(plain, root / "fp8", BLOCKS[family])
            built[family] = fp8, dequantize_checkpoint_fp8(fp8, root / "dequantized")
        return built[family]

    return get


def greedy(model_dir: Path, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    with LLM(str(model_dir), num_kv_blocks=64, device="cpu", **engine) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# --- the layout ----------------------------------------------------------------------------------


def test_the_written_v3_checkpoint_quantizes_every_projection_but_the_router(fp8_dirs):
    fp8, _ = fp8_dirs("deepseek_v3")
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        kv_a = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
        kv_a_scale = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
        router = f.get_tensor("model.layers.1.mlp.gate.weight")
    scaled = {n.removesuffix(".weight_scale_inv") for n in names if n.endswith("weight_scale_inv")}
    attention = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    mlp = {"gate_proj", "up_proj", "down_proj"}
    expected = {f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in attention}
    expected |= {f"model.layers.0.mlp.{p}" for p in mlp}  # the dense first layer
    for i in (1, 2):
        expected |= {f"model.layers.{i}.mlp.shared_experts.{p}" for p in mlp}
        expected |= {f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(8) for p in mlp}
    assert scaled == expected
    assert kv_a.dtype == FP8 and kv_a.shape == (40, 64) and kv_a_scale.shape == (3, 4)
    assert router.dtype == torch.float32
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral"])
def test_fp8_greedy_tokens_equal_the_dequantized_model_and_transformers(family, fp8_dirs):
    fp8, dequantized = fp8_dirs(family)
    prompts = random_prompts(11, PROMPT_LENGTHS)
    tokens = greedy(fp8, prompts)
    assert tokens == greedy(dequantized, prompts)
    assert tokens == hf_greedy(dequantized, prompts, GREEDY.max_tokens)


def test_tensor_parallel_fp8_deepseek_gives_the_tokens_of_one_rank(fp8_dirs):
    fp8, _ = fp8_dirs("deepseek_v3")
    prompts = random_prompts(12, PROMPT_LENGTHS)
    assert greedy(fp8, prompts, tensor_parallel_size=2) == greedy(fp8, prompts)


# --- memory --------------------------------------------------------------------------------------


def test_experts_and_latent_attention_stay_fp8_at_about_half_of_bfloat16(fp8_dirs):
    fp8, _ = fp8_dirs("deepseek_v3")
    model = load_model(fp8, "bfloat16", "cpu")
    stacks = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    # Two sparse layers; per layer in_proj, q_b_proj and o_proj, plus layer 0's gate_up and
    # down and each sparse layer's shared expert's two.
    assert len(stacks) == 2 and len(linears) == 3 * 3 + 2 + 2 * 2
    experts = stacks[0]
    assert experts.w13.dtype == experts.w2.dtype == FP8
    assert experts.w13_scale_inv.dtype == torch.float32
    # 8 experts of width 32 over a hidden size of 64, in blocks of 16: gate and up 2 x 2 x 4
    # scales each, down 4 x 2.
    fp8_bytes = 8 * (2 * 32 * 64 + 64 * 32)
    scale_bytes = 4 * 8 * (2 * 2 * 4 + 4 * 2)
    assert sum(p.nbytes for p in experts.parameters()) == fp8_bytes + scale_bytes
    quantized = stacks + linears
    held = sum(p.nbytes for m in quantized for p in m.parameters())
    bf16 = 2 * sum(
        p.numel() for m in quantized for n, p in m.named_parameters() if "scale" not in n
    )
    assert 0.5 * bf16 < held < 0.53 * bf16
    line = weight_line(model)
    assert "in 15 linear layers and 2 layers' experts kept in fp8 e4m3, blocks of 16x16" in line


def test_kv_b_proj_is_dequantized_once_into_the_absorbed_weights(fp8_dirs):
    fp8, _ = fp8_dirs("deepseek_v3")
    model = load_model(fp8, "float32", "cpu")
    attention = model.layers[2].self_attn
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        name = "model.layers.2.self_attn.kv_b_proj."
        w = dequantize(
            f.get_tensor(name + "weight"), f.get_tensor(name + "weight_scale_inv"), (16, 16)
        )
    w = w.view(4, 16 + 24, 32)
    assert torch.equal(attention.w_uk, w[:, :16]) and torch.equal(attention.w_uv, w[:, 16:])


# --- the published config and refusals -----------------------------------------------------------

# DeepSeek-V3's published config.json (its fields that pdserve reads), quantization_config included.
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def test_the_published_v3_config_loads_and_splits_on_eight_and_sixteen_gpus():
    cfg = ModelConfig.from_dict(V3_CONFIG)
    scheme = cfg.quantization
    assert scheme.block == (128, 128)
    for module in (
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.self_attn.kv_b_proj",
        "model.layers.5.mlp.experts.255.down_proj",
        "model.layers.5.mlp.shared_experts.gate_proj",
    ):
        assert scheme.quantizes(module)
    assert not scheme.quantizes("model.layers.5.mlp.gate")
    TPShard(0, 8).check(cfg)
    TPShard(0, 16).check(cfg)
    with pytest.raises(ValueError) as err:  # 18432 / 32 = 576 dense MLP columns a rank
        TPShard(0, 32).check(cfg)
    assert "rank 1's rows of gate_proj and up_proj start at 576, inside a block of 128" in (
        str(err.value)
    )
    sparse = ModelConfig.from_dict({**V3_CONFIG, "first_k_dense_replace": 0})
    with pytest.raises(ValueError) as err:  # 2048 / 32 = 64 expert columns a rank
        TPShard(0, 32).check(sparse)
    message = str(err.value)
    assert "tensor_parallel_size=32: rank 1's rows of experts' gate_proj and up_proj start at " in (
        message
    )
    assert "start at 64, inside a block of 128" in message


def test_an_mla_rank_share_inside_a_block_is_refused_naming_the_projection():
    cfg = ModelConfig.from_dict(
        {
            **V3_CONFIG,
            "quantization_config": {
                **V3_CONFIG["quantization_config"],
                "weight_block_size": [256, 128],
            },
        }
    )
    with pytest.raises(ValueError) as err:  # 128 heads / 128 ranks: one head of 192 q_b rows
        TPShard(0, 128).check(cfg)
    assert "rank 1's rows of q_b_proj start at 192, inside a block of 256" in str(err.value)


def test_one_expert_left_unquantized_is_refused_naming_the_field(fp8_dirs):
    fp8, _ = fp8_dirs("qwen3_moe")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["mlp.experts.3."]
    from pdserve.engine.models.loader import build_model

    with pytest.raises(ValueError) as err:
        build_model(ModelConfig.from_dict(cfg), "float32", "cpu")
    message = str(err.value)
    assert "\n" not in message
    assert "'quantization_config.modules_to_not_convert'" in message
    assert "model.layers.0.mlp.experts unquantized but not all" in message


@pytest.mark.parametrize(
    "change,expected",
    [
        (
            lambda t, n: t.__setitem__(n + "weight_scale_inv", t[n + "weight_scale_inv"][:1]),
            "up_proj.weight_scale_inv' has shape (1, 2), expected (2, 2) (blocks of 32x32)",
        ),
        (
            lambda t, n: t.__setitem__(n + "weight", t[n + "weight"].float()),
            "up_proj.weight' is stored as F32; an FP8 checkpoint (quantization_config) stores "
            "it as F8_E4M3",
        ),
        (
            lambda t, n: t.pop(n + "weight_scale_inv"),
            "missing weight 'model.layers.2.mlp.experts.1.up_proj.weight_scale_inv'",
        ),
    ],
    ids=["misshapen-scale", "float-weight", "missing-scale"],
)
def test_a_broken_expert_tensor_is_refused_naming_it(fp8_dirs, tmp_path, change, expected):
    fp8, _ = fp8_dirs("qwen3_moe")
    broken = tmp_path / "broken"
    shutil.copytree(fp8, broken)
    tensors = load_file(broken / "model.safetensors")
    change(tensors, "model.layers.2.mlp.experts.1.up_proj.")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load_model(broken, "float32", "cpu")
    assert expected in str(err.value)


# --- served --------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_pdserve_serve_disaggregated_gives_the_offline_fp8_deepseek_tokens(fp8_dirs, tmp_path):
    fp8, _ = fp8_dirs("deepseek_v3")
    prompt = random_prompts(13, [14])[0]
    with LLM(str(fp8), num_kv_blocks=64, device="cpu") as llm:
        (out,) = llm.generate([prompt], GREEDY)
        expected = llm.tokenizer.decode(out.token_ids)
    system = PdserveSystem("fp8-v3", prefill_nodes=1, decode_nodes=1, flags=("--insecure",))
    with PdserveServer(system, tmp_path, str(fp8)) as server:
        body = {
            "model": httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": GREEDY.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
        logs = "".join(p.read_text() for p in (tmp_path / "fp8-v3").rglob("*.log"))
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == GREEDY.max_tokens
    assert "2 layers' experts kept in fp8 e4m3, blocks of 16x16" in logs
