"""gpt-oss from a tiny transformers checkpoint (4 layers alternating a window of 8 and full
attention, attention sinks, YaRN, 4 experts top-2 with biases and a clamped SwiGLU): its config
is read as transformers reads it, defaults included; the engine reports its layer kinds; a
bfloat16 checkpoint loads as stored; a checkpoint without a sink or with a misshapen expert is
refused; the MXFP4 release's config quantizes the experts only (served in test_quant_mxfp4.py). Its greedy parity with transformers (block sizes, chunked
prefill, prefix hits, preemption, TP=2, and divergence without its sinks, its clamp or its
router's bias) is in test_windowed_family_parity.py."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from windowed_families import WINDOWED_FAMILIES

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ClampedSwiGLU, ModelConfig, UnsupportedModelError
from pdserve.engine.models.llama import LlamaForCausalLM

FAMILY = WINDOWED_FAMILIES["gpt_oss"]
WINDOW = 8  # the checkpoint's sliding_window
KINDS = (f"sliding {WINDOW}", "full", f"sliding {WINDOW}", "full")


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("gpt_oss")


# --- the config ----------------------------------------------------------------------------------


def test_the_config_reads_every_choice_of_the_checkpoint(model_dir):
    import transformers

    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.layer_kinds == KINDS
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias
    assert cfg.clamped_swiglu == ClampedSwiGLU(alpha=1.3, limit=1.0)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (24, 4, 2)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 48)
    assert cfg.sparse_layers == (0, 1, 2, 3)
    # The rotary table is transformers' (YaRN's frequencies and attention factor), not plain.
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf_config)
    positions = torch.arange(cfg.max_position_embeddings)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    table = LlamaForCausalLM._rotary_table(cfg)
    torch.testing.assert_close(table, torch.cat([cos[0], sin[0]], dim=-1))
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    plain = ModelConfig.from_dict({**hf_config.to_dict(), "rope_parameters": default_rope})
    assert not torch.allclose(LlamaForCausalLM._rotary_table(plain), table)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_hidden_layers": 3},  # transformers' defaults, YaRN included
        {  # a release's config: rope_theta and rope_scaling apart, truncate unset (true)
            "num_hidden_layers": 2,
            "head_dim": 32,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "original_max_position_embeddings": 4096,
            },
            "layer_types": ["full_attention", "sliding_attention"],
            "sliding_window": 64,
            "swiglu_limit": 5.0,
        },
    ],
)
def test_a_config_is_read_as_transformers_reads_it(fields):
    import transformers

    raw = {"model_type": "gpt_oss", **fields}
    hf = transformers.GptOssConfig.from_dict(raw)
    cfg = ModelConfig.from_dict(raw)
    windows = {"sliding_attention": f"sliding {hf.sliding_window}", "full_attention": "full"}
    assert cfg.layer_kinds == tuple(windows[t] for t in hf.layer_types)
    assert cfg.head_dim == hf.head_dim and cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.num_experts == hf.num_local_experts
    assert cfg.num_experts_per_tok == hf.num_experts_per_tok
    assert cfg.clamped_swiglu == ClampedSwiGLU(hf.swiglu_alpha, hf.swiglu_limit)
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf)
    torch.testing.assert_close(cfg.inv_freq(), rotary.inv_freq)
    assert cfg.rotary_attention_factor() == pytest.approx(rotary.attention_scaling)


def test_the_mxfp4_release_loads_with_its_experts_quantized_and_other_formats_are_refused():
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    cfg = ModelConfig.from_dict({"model_type": "gpt_oss", "quantization_config": mxfp4})
    assert cfg.quantization.quantizes("model.layers.0.mlp.experts")
    assert not cfg.quantization.quantizes("model.layers.0.self_attn.q_proj")
    awq = {"quant_method": "awq", "bits": 4}
    with pytest.raises(UnsupportedModelError, match="'quantization_config.quant_method' = 'awq'"):
        ModelConfig.from_dict({"model_type": "gpt_oss", "quantization_config": awq})


# --- serving it ----------------------------------------------------------------------------------


def test_the_engine_loads_it_and_reports_its_layer_kinds(model_dir):
    llm = LLM(str(model_dir))
    assert llm.engine.layout.layer_kinds == KINDS
    layers = llm.engine.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["GptOssMoE"] * 4
    assert all(layer.self_attn.sinks.shape == (4,) for layer in layers)


def test_a_bfloat16_checkpoint_loads_as_stored_and_starts_as_transformers_does(model_dir, tmp_path):
    import transformers

    prompts = FAMILY.prompts()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    llm = LLM(str(tmp_path), block_size=4, num_kv_blocks=600, device="cpu", dtype="bfloat16")
    stored = load_file(tmp_path / "model.safetensors")
    layer = llm.engine.model.layers[1]
    assert torch.equal(layer.self_attn.sinks, stored["model.layers.1.self_attn.sinks"])
    assert torch.equal(layer.mlp.gate_up_proj, stored["model.layers.1.mlp.experts.gate_up_proj"])
    # bfloat16 rounds differently here and there (the engine routes and sums experts in float32):
    # the first token of each prompt, not whole continuations.
    firsts = []
    with torch.no_grad():
        for prompt in prompts:
            logits = hf(torch.tensor([prompt])).logits[0, -1]
            firsts.append(int(logits.argmax()))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    assert [o.token_ids[0] for o in llm.generate(prompts, one)] == firsts


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", "missing weight 'model.layers.1.self_attn.sinks'"),
        ("reshape", "'model.layers.2.mlp.experts.gate_up_proj' has shape (4, 64, 48)"),
    ],
)
def test_a_checkpoint_without_a_sink_or_with_a_misshapen_expert_is_refused(
    model_dir, tmp_path, change, message
):
    shutil.copytree(model_dir, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(path)
    if change == "drop":
        del tensors["model.layers.1.self_attn.sinks"]
    else:
        name = "model.layers.2.mlp.experts.gate_up_proj"
        tensors[name] = tensors[name][..., :48].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        LLM(str(tmp_path / "ckpt"), num_kv_blocks=16, device="cpu")
