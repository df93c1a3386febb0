"""Gemma 3 from transformers' own tiny checkpoints (7 layers, 5 sliding to 1 full, a window of 8,
local and global rope bases apart, query_pre_attn_scalar apart from head_dim, (1 + weight) norms
around zero, a logit cap): its KV groups and settings are read; the capped logits'
log-probabilities equal transformers'; a multimodal checkpoint's text model equals
Gemma3ForConditionalGeneration on text; 4.x configs, the Hub's sparse text_config and what pdserve
cannot run are read or refused. Its greedy parity with transformers (block sizes, chunked prefill
splitting a window, prefix hits, preemption, TP=2) is in test_windowed_family_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import hf_greedy
from windowed_families import WINDOWED_FAMILIES

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.groups import groups_for
from pdserve.engine.models.config import ModelConfig, UnsupportedModelError

FAMILY = WINDOWED_FAMILIES["gemma3_text"]
GREEDY = FAMILY.greedy


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("gemma3_text")


def test_the_checkpoint_has_several_kv_groups_and_gemmas_own_settings(model_dir):
    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.layer_kinds == ("sliding 8",) * 5 + ("full", "sliding 8")
    assert cfg.local_rope_layers == (0, 1, 2, 3, 4, 6)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (50000.0, 100.0)
    assert cfg.rope_scaling["rope_type"] == "linear"
    assert cfg.local_rope_scaling["rope_type"] == "default"
    assert cfg.attention_scale == 20**-0.5 != cfg.head_dim**-0.5
    assert cfg.final_logit_softcapping == 5.0
    assert groups_for(cfg.num_layers, cfg.layer_kinds).num_groups == 7


def test_capped_logits_give_transformers_logprobs(windowed_reference):
    """The cap (tanh) keeps the argmax: log-probabilities are what test it."""
    import transformers

    model_dir, prompts, expected = windowed_reference("gemma3_text")
    model = transformers.Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompts[2] + expected[2]])
    scored = slice(len(prompts[2]) - 1, -1)
    with torch.no_grad():
        logits = model(ids).logits[0, scored]
        uncapped = model.lm_head(model.model(ids).last_hidden_state)[0, scored]
    hf = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(expected[2])[:, None])
    # The cap bends these logits: without it the log-probabilities would be others.
    assert (
        torch.log_softmax(uncapped, dim=-1) - torch.log_softmax(logits, dim=-1)
    ).abs().max() > 0.1
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    params = SamplingParams(
        max_tokens=FAMILY.new_tokens, temperature=0, ignore_eos=True, logprobs=0
    )
    (out,) = llm.generate([prompts[2]], params)
    assert out.token_ids == expected[2]
    ours = torch.tensor([lp["token"][1] for lp in out.logprobs])
    torch.testing.assert_close(ours, hf[:, 0], rtol=0, atol=1e-4)


def test_multimodal_checkpoints_text_model_matches_conditional_generation(checkpoint_dir):
    model_dir = checkpoint_dir("gemma3")
    prompts = FAMILY.prompts()
    expected = hf_greedy(model_dir, prompts, FAMILY.new_tokens, "Gemma3ForConditionalGeneration")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "gemma3" and "vision_config" in cfg
    llm = LLM(str(model_dir), block_size=5, num_kv_blocks=600, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


# --- configs -----------------------------------------------------------------------------------


def test_a_4x_config_reads_like_the_5x_one(model_dir):
    """Hub checkpoints written by transformers 4.x carry rope_theta, rope_scaling (the full
    layers') and rope_local_base_freq instead of rope_parameters by layer type, and
    sliding_window_pattern instead of layer_types."""
    new = json.loads((model_dir / "config.json").read_text())
    old = dict(new)
    del old["rope_parameters"], old["layer_types"]
    old.update(
        rope_theta=50000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_local_base_freq=100.0,
        sliding_window_pattern=6,
        hidden_act="gelu_pytorch_tanh",
    )
    assert ModelConfig.from_dict(old) == ModelConfig.from_dict(new)


def test_a_multimodal_text_config_takes_gemma3s_defaults():
    # gemma-3-4b's shape: its text_config names neither heads, head_dim nor rope bases.
    cfg = ModelConfig.from_dict(
        {
            "model_type": "gemma3",
            "eos_token_id": [1, 106],
            "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"model_type": "siglip_vision_model"},
        }
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 256)
    assert cfg.attention_scale == 256**-0.5
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
    assert cfg.torch_dtype == "bfloat16" and cfg.mlp_activation == "gelu_pytorch_tanh"
    assert cfg.layer_kinds == (("sliding 1024",) * 5 + ("full",)) * 5 + ("sliding 1024",) * 4
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (1e4, {"rope_type": "default"})
    assert cfg.final_logit_softcapping == 0.0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "longrope"}}},
            "rope_parameters.sliding_attention.rope_type",
        ),
    ],
)
def test_what_pdserve_cannot_run_is_refused_by_name(model_dir, change, field):
    cfg = {**json.loads((model_dir / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(cfg)
