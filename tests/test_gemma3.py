"""Gemma 3 from transformers' own tiny checkpoints (7 layers, 5 sliding to 1 full, a window of 8,
local and global rope bases apart, query_pre_attn_scalar apart from head_dim, (1 + weight) norms
around zero, a logit cap): greedy tokens equal transformers' in float32 with prompts several windows
long, at block sizes that do and do not divide the window, with chunked prefill splitting a window,
with a prefix-cache hit, after preemption and at TP=2; the capped logits' log-probabilities equal
transformers'; a multimodal checkpoint's text model equals Gemma3ForConditionalGeneration on text;
4.x configs, the Hub's sparse text_config and what pdserve cannot run are read or refused."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import hf_greedy
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.groups import groups_for
from pdserve.engine.models.config import ModelConfig, UnsupportedModelError

NEW_TOKENS = 24
WINDOW = 8  # the families' sliding_window
# Several windows long; 70 takes the CPU attention's SDPA prefill path (64 query tokens or more).
PROMPT_LENGTHS = [3, 13, 30, 70]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# The transformers class each family's checkpoint is, and is compared with.
HF_CLASS = {"gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    cache = {}

    def get(family: str):
        if family not in cache:
            model_dir = checkpoint_dir(family)
            prompts = random_prompts(5, PROMPT_LENGTHS)
            expected = hf_greedy(model_dir, prompts, NEW_TOKENS, HF_CLASS[family])
            cache[family] = (model_dir, prompts, expected)
        return cache[family]

    return get


def test_the_checkpoint_has_several_kv_groups_and_gemmas_own_settings(reference):
    model_dir, _, _ = reference("gemma3_text")
    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.layer_kinds == ("sliding 8",) * 5 + ("full", "sliding 8")
    assert cfg.local_rope_layers == (0, 1, 2, 3, 4, 6)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (50000.0, 100.0)
    assert cfg.rope_scaling["rope_type"] == "linear"
    assert cfg.local_rope_scaling["rope_type"] == "default"
    assert cfg.attention_scale == 20**-0.5 != cfg.head_dim**-0.5
    assert cfg.final_logit_softcapping == 5.0
    assert groups_for(cfg.num_layers, cfg.layer_kinds).num_groups == 7


@pytest.mark.parametrize("block_size", [4, 5])
def test_greedy_matches_transformers_at_block_sizes_that_do_and_do_not_divide_the_window(
    reference, block_size
):
    model_dir, prompts, expected = reference("gemma3_text")
    llm = LLM(str(model_dir), block_size=block_size, num_kv_blocks=600, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_chunked_prefill_splitting_windows_matches_transformers(reference):
    model_dir, prompts, expected = reference("gemma3_text")
    # 11 tokens a step: chunks end inside windows and blocks.
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, max_num_batched_tokens=11)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_a_prefix_hit_gives_the_same_tokens(reference):
    model_dir, prompts, expected = reference("gemma3_text")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_sequences_resume_with_transformers_tokens(reference):
    model_dir, prompts, expected = reference("gemma3_text")
    # A pool too small for every sequence at once: the newest are preempted and recomputed.
    llm = LLM(
        str(model_dir), block_size=4, num_kv_blocks=80, max_num_batched_tokens=16, device="cpu"
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_capped_logits_give_transformers_logprobs(reference):
    """The cap (tanh) keeps the argmax: log-probabilities are what test it."""
    import transformers

    model_dir, prompts, expected = reference("gemma3_text")
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
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([prompts[2]], params)
    assert out.token_ids == expected[2]
    ours = torch.tensor([lp["token"][1] for lp in out.logprobs])
    torch.testing.assert_close(ours, hf[:, 0], rtol=0, atol=1e-4)


def test_multimodal_checkpoints_text_model_matches_conditional_generation(reference):
    model_dir, prompts, expected = reference("gemma3")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "gemma3" and "vision_config" in cfg
    llm = LLM(str(model_dir), block_size=5, num_kv_blocks=600, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.cluster
def test_tensor_parallel_greedy_tokens_equal_transformers(reference):
    model_dir, prompts, expected = reference("gemma3_text")
    with LLM(
        str(model_dir), block_size=4, num_kv_blocks=600, device="cpu", tensor_parallel_size=2
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


# --- configs -----------------------------------------------------------------------------------


def test_a_4x_config_reads_like_the_5x_one(reference):
    """Hub checkpoints written by transformers 4.x carry rope_theta, rope_scaling (the full
    layers') and rope_local_base_freq instead of rope_parameters by layer type, and
    sliding_window_pattern instead of layer_types."""
    model_dir, _, _ = reference("gemma3_text")
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
def test_what_pdserve_cannot_run_is_refused_by_name(reference, change, field):
    model_dir, _, _ = reference("gemma3_text")
    cfg = {**json.loads((model_dir / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(cfg)
