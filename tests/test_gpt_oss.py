"""gpt-oss from a tiny transformers checkpoint (4 layers alternating a window of 8 and full
attention, attention sinks, YaRN, 4 experts top-2 with biases and a clamped SwiGLU): greedy
tokens equal transformers' in float32 with prompts several windows long (one through the CPU
attention's SDPA prefill path), at block sizes that do and do not divide the window, with chunked
prefill splitting windows, with a prefix-cache hit, after preemption and on two tensor-parallel
ranks; without its sinks, its clamp or its router's bias they do not, so the parity tests each.
Its config is read as transformers reads it, defaults included; its MXFP4 release is refused."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from checkpoints import hf_greedy
from conftest import random_prompts
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ClampedSwiGLU, ModelConfig, UnsupportedModelError
from pdserve.engine.models.llama import LlamaForCausalLM

NEW_TOKENS = 32
WINDOW = 8  # the checkpoint's sliding_window
# Several windows long; 70 takes the CPU attention's SDPA prefill path (64 query tokens or more).
PROMPT_LENGTHS = [3, 11, 29, 70]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
KINDS = (f"sliding {WINDOW}", "full", f"sliding {WINDOW}", "full")


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    """(model dir, prompts, transformers' greedy tokens), made once."""
    model_dir = checkpoint_dir("gpt_oss")
    prompts = random_prompts(5, PROMPT_LENGTHS)
    return model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS)


def generate(model_dir, prompts, **options) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", **options)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# --- the config ----------------------------------------------------------------------------------


def test_the_config_reads_every_choice_of_the_checkpoint(reference):
    import transformers

    model_dir, _, _ = reference
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


def test_the_mxfp4_release_is_refused():
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with pytest.raises(UnsupportedModelError, match="'quantization_config' \\(mxfp4\\)"):
        ModelConfig.from_dict({"model_type": "gpt_oss", "quantization_config": mxfp4})


# --- serving it ----------------------------------------------------------------------------------


def test_the_engine_loads_it_and_reports_its_layer_kinds(reference):
    model_dir, _, _ = reference
    llm = LLM(str(model_dir))
    assert llm.engine.layout.layer_kinds == KINDS
    layers = llm.engine.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["GptOssMoE"] * 4
    assert all(layer.self_attn.sinks.shape == (4,) for layer in layers)


@pytest.mark.parametrize("block_size", [4, 5])
def test_greedy_matches_transformers_at_block_sizes_that_do_and_do_not_divide_the_window(
    reference, block_size
):
    model_dir, prompts, expected = reference
    assert generate(model_dir, prompts, block_size=block_size, num_kv_blocks=600) == expected


def test_chunked_prefill_splitting_windows_matches_transformers(reference):
    model_dir, prompts, expected = reference
    # 13 tokens a step: chunks end inside windows and blocks.
    options = dict(block_size=4, num_kv_blocks=600, max_num_batched_tokens=13)
    assert generate(model_dir, prompts, **options) == expected


def test_a_prefix_hit_gives_the_same_tokens(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_sequences_resume_with_transformers_tokens(reference):
    model_dir, prompts, expected = reference
    # A pool too small for every sequence at once: the newest are preempted and recomputed.
    llm = LLM(
        str(model_dir), block_size=4, num_kv_blocks=48, max_num_batched_tokens=16, device="cpu"
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_two_tensor_parallel_ranks_match_transformers(reference):
    # Each rank: 2 of the 4 query heads and their sinks, 1 of the 2 KV heads, 24 of every
    # expert's 48 columns; the first rank adds the down projections' biases.
    model_dir, prompts, expected = reference
    options = dict(block_size=4, num_kv_blocks=200, device="cpu", tensor_parallel_size=2)
    with LLM(str(model_dir), **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def _no_sinks(layer) -> None:  # noqa: ANN001
    layer.self_attn.sinks = None


def _no_clamp(layer) -> None:  # noqa: ANN001
    layer.mlp.limit = math.inf


def _no_router_bias(layer) -> None:  # noqa: ANN001
    layer.mlp.router.bias.data.zero_()


@pytest.mark.parametrize("remove", [_no_sinks, _no_clamp, _no_router_bias])
def test_without_the_sinks_the_clamp_or_the_router_bias_every_prompt_diverges(reference, remove):
    """What makes the parity above a test of each: this checkpoint's tokens depend on them."""
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    for layer in llm.engine.model.layers:
        remove(layer)
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(got != want for got, want in zip(outs, expected))


def test_a_bfloat16_checkpoint_loads_as_stored_and_starts_as_transformers_does(reference, tmp_path):
    import transformers

    model_dir, prompts, _ = reference
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
    reference, tmp_path, change, message
):
    model_dir, _, _ = reference
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
