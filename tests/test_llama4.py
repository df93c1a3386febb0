"""Llama 4's text model from tiny transformers checkpoints (4 layers: 3 chunked rotary layers with
chunks of 8 and the QK L2 norm, 1 full-attention NoPE layer whose temperature changes every 4
positions; dense layers between sparse ones of 4 experts top-1 with a shared expert): the config
is read as transformers reads it, defaults included; greedy tokens equal transformers' in float32
with the experts on plain weights (the op table's fused_moe) as on packed ones, and with two
experts a token; a Llama4ForConditionalGeneration checkpoint serves its text model, its vision
weights unread; a checkpoint without a shared expert or with a misshapen expert is refused. Its
greedy parity with transformers (block sizes, chunked prefill splitting chunks, prefix hits,
preemption, TP=2, and divergence without the temperature, the QK norm or the chunking) is in
test_windowed_family_parity.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import hf_greedy, hf_model_greedy
from conftest import random_prompts
from safetensors.torch import load_file, save_file
from windowed_families import WINDOWED_FAMILIES

from pdserve.engine import LLM
from pdserve.engine.models.config import Llama4Attention, ModelConfig, UnsupportedModelError

FAMILY = WINDOWED_FAMILIES["llama4_text"]
GREEDY = FAMILY.greedy
CHUNK = 8  # the checkpoints' attention_chunk_size
KINDS = (f"chunked {CHUNK}",) * 3 + ("full",)


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("llama4_text")


def generate(model_dir, prompts, **options) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", **options)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# --- the config ----------------------------------------------------------------------------------


def test_the_config_reads_every_choice_of_the_checkpoint(model_dir):
    import transformers

    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.model_type == "llama4_text" and cfg.weights_prefix == ""
    assert cfg.layer_kinds == KINDS
    assert cfg.llama4 == Llama4Attention(
        rope_layers=(True, True, True, False),
        qk_l2_norm=True,
        temperature_tuning=True,
        floor_scale=4.0,
        attn_scale=0.5,
    )
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (24, 4, 2)
    assert cfg.sparse_layers == (1, 3)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 1)
    # Experts and the shared expert intermediate_size wide, the dense layers intermediate_size_mlp.
    assert cfg.moe_intermediate_size == cfg.shared_expert_intermediate_size == 48
    assert cfg.intermediate_size == 96
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    rotary = transformers.models.llama4.modeling_llama4.Llama4TextRotaryEmbedding(hf_config)
    torch.testing.assert_close(cfg.inv_freq(), rotary.inv_freq)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_hidden_layers": 5},  # transformers' defaults
        {  # a release's config as transformers 4.51 wrote it: rope_theta and llama3 scaling apart
            "num_hidden_layers": 6,
            "head_dim": 32,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "no_rope_layers": [1, 0, 1, 1, 0, 1],
            "moe_layers": [0, 5],
            "use_qk_norm": False,
            "attn_temperature_tuning": False,
            "floor_scale": 512,
            "attn_scale": 0.25,
        },
        {"num_hidden_layers": 4, "attention_chunk_size": None, "interleave_moe_layer_step": 2},
        {"num_hidden_layers": 3, "hidden_size": 256, "num_attention_heads": 4},  # head_dim 128
    ],
)
def test_a_config_is_read_as_transformers_reads_it(fields):
    import transformers

    raw = {"model_type": "llama4_text", **fields}
    hf = transformers.Llama4TextConfig.from_dict(raw)
    cfg = ModelConfig.from_dict(raw)
    kinds = tuple(
        f"chunked {hf.attention_chunk_size}" if t == "chunked_attention" else "full"
        for t in hf.layer_types
    )
    assert cfg.layer_kinds == (kinds if any(k != "full" for k in kinds) else ())
    n = hf.num_hidden_layers
    assert cfg.llama4.rope_layers == tuple(bool(r) for r in hf.no_rope_layers[:n])
    assert cfg.llama4.qk_l2_norm == hf.use_qk_norm
    assert cfg.llama4.temperature_tuning == hf.attn_temperature_tuning
    assert (cfg.llama4.floor_scale, cfg.llama4.attn_scale) == (hf.floor_scale, hf.attn_scale)
    assert cfg.head_dim == hf.head_dim and cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.sparse_layers == tuple(i for i in range(n) if i in hf.moe_layers)
    assert cfg.num_experts == hf.num_local_experts
    assert cfg.num_experts_per_tok == hf.num_experts_per_tok
    assert cfg.moe_intermediate_size == cfg.shared_expert_intermediate_size == hf.intermediate_size
    assert cfg.intermediate_size == hf.intermediate_size_mlp
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))
    rotary = transformers.models.llama4.modeling_llama4.Llama4TextRotaryEmbedding(hf)
    torch.testing.assert_close(cfg.inv_freq(), rotary.inv_freq)
    assert cfg.rotary_attention_factor() == pytest.approx(rotary.attention_scaling)


def test_a_multimodal_config_is_read_as_its_text_config():
    text = {"model_type": "llama4_text", "num_hidden_layers": 4, "floor_scale": 16}
    wrapper = {
        "model_type": "llama4",
        "text_config": text,
        "vision_config": {},
        "dtype": "bfloat16",
    }
    cfg = ModelConfig.from_dict(wrapper)
    assert cfg.weights_prefix == "language_model."
    assert cfg.torch_dtype == "bfloat16"  # the wrapper's, the text config naming none
    alone = ModelConfig.from_dict({**text, "dtype": "bfloat16"})
    assert cfg.llama4 == alone.llama4 and cfg.layer_kinds == alone.layer_kinds
    assert cfg.sparse_layers == alone.sparse_layers
    fp8 = {"quant_method": "fbgemm_fp8"}  # the wrapper's, as Maverick's FP8 release has it
    with pytest.raises(UnsupportedModelError, match="'quantization_config' \\(fbgemm_fp8\\)"):
        ModelConfig.from_dict({**wrapper, "quantization_config": fp8})


# --- serving it ----------------------------------------------------------------------------------


def test_the_engine_loads_it_and_reports_its_layer_kinds(model_dir):
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64)
    assert llm.engine.layout.layer_kinds == KINDS
    layers = llm.engine.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["MLP", "Llama4MoE"] * 2
    assert [layer.self_attn.mask for layer in layers] == [{"chunk": CHUNK}] * 3 + [{}]
    # A CPU node's default, as the parity tests run it: the experts on packed weights (oneDNN).
    assert layers[1].mlp.experts.packed_experts is not None


def test_the_experts_on_plain_weights_match_transformers(windowed_reference):
    # cpu_linear torch: the experts through the op table's fused_moe, not packed for oneDNN.
    model_dir, prompts, expected = windowed_reference("llama4_text")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu", cpu_linear="torch")
    assert llm.engine.model.layers[1].mlp.experts.packed_experts is None
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_two_experts_a_token_match_transformers(model_dir, tmp_path):
    # Top-2: each token enters two experts, each scaled by its own score, the outputs summed.
    prompts = FAMILY.prompts()
    top2 = shutil.copytree(model_dir, tmp_path / "top2")
    config = json.loads((top2 / "config.json").read_text())
    (top2 / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 2}))
    expected = hf_greedy(top2, prompts, FAMILY.new_tokens)
    assert generate(top2, prompts, block_size=4, num_kv_blocks=600) == expected


# --- the multimodal checkpoint's text model ------------------------------------------------------


def test_a_multimodal_checkpoints_text_model_gives_transformers_tokens(checkpoint_dir):
    import transformers

    model_dir = checkpoint_dir("llama4")
    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    # On text alone the wrapper embeds the tokens and runs its language model; transformers
    # 5.24's wrapper forward then fails reading `image_outputs` from that model's output, so
    # its language model, loaded through the wrapper, generates the reference.
    prompts = random_prompts(6, list(FAMILY.prompt_lengths))
    expected = hf_model_greedy(hf.language_model, prompts, FAMILY.new_tokens)
    llm = LLM(str(model_dir), block_size=5, num_kv_blocks=600, device="cpu")
    assert llm.engine.model.config.weights_prefix == "language_model."
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", "missing weight 'model.layers.3.feed_forward.shared_expert.up_proj.weight'"),
        ("reshape", "'model.layers.1.feed_forward.experts.gate_up_proj' has shape (4, 64, 48)"),
    ],
)
def test_a_checkpoint_without_a_shared_expert_or_with_a_misshapen_expert_is_refused(
    model_dir, tmp_path, change, message
):
    shutil.copytree(model_dir, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(path)
    if change == "drop":
        del tensors["model.layers.3.feed_forward.shared_expert.up_proj.weight"]
    else:
        name = "model.layers.1.feed_forward.experts.gate_up_proj"
        tensors[name] = tensors[name][..., :48].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        LLM(str(tmp_path / "ckpt"), num_kv_blocks=16, device="cpu")
