"""Llama 4's text model from tiny transformers checkpoints (4 layers: 3 chunked rotary layers with
chunks of 8 and the QK L2 norm, 1 full-attention NoPE layer whose temperature changes every 4
positions; dense layers between sparse ones of 4 experts top-1 with a shared expert): greedy
tokens equal transformers' in float32 for prompts several chunks long (one through the CPU
attention's SDPA prefill path), at block sizes that do and do not divide the chunk, with chunked
prefill splitting chunks, with a prefix-cache hit, after preemption, on two tensor-parallel ranks,
with the experts on packed or plain weights and with two experts a token; without the
temperature, the QK norm or the chunking they do not, so the parity tests each.
A Llama4ForConditionalGeneration checkpoint serves its text model, its vision weights unread. The
config is read as transformers reads it, defaults included."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import hf_greedy, hf_model_greedy
from conftest import random_prompts
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import Llama4Attention, ModelConfig, UnsupportedModelError

NEW_TOKENS = 32
CHUNK = 8  # the checkpoints' attention_chunk_size
# Several chunks long; 70 takes the CPU attention's SDPA prefill path (64 query tokens or more).
PROMPT_LENGTHS = [3, 11, 29, 70]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
KINDS = (f"chunked {CHUNK}",) * 3 + ("full",)


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    """(model dir, prompts, transformers' greedy tokens) of the text checkpoint, made once."""
    model_dir = checkpoint_dir("llama4_text")
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


def test_the_engine_loads_it_and_reports_its_layer_kinds(reference):
    model_dir, _, _ = reference
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64)
    assert llm.engine.layout.layer_kinds == KINDS
    layers = llm.engine.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["MLP", "Llama4MoE"] * 2
    assert [layer.self_attn.mask for layer in layers] == [{"chunk": CHUNK}] * 3 + [{}]


@pytest.mark.parametrize(("block_size", "cpu_linear"), [(4, "onednn"), (5, "onednn"), (4, "torch")])
def test_greedy_matches_transformers_at_block_sizes_that_do_and_do_not_divide_the_chunk(
    reference, block_size, cpu_linear
):
    # onednn: the experts on packed weights (a CPU node's default); torch: the fused_moe op
    model_dir, prompts, expected = reference
    llm = LLM(
        str(model_dir),
        block_size=block_size,
        num_kv_blocks=600,
        device="cpu",
        cpu_linear=cpu_linear,
    )
    experts = llm.engine.model.layers[1].mlp.experts
    assert (experts.packed_experts is not None) == (cpu_linear == "onednn")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_two_experts_a_token_match_transformers(reference, tmp_path):
    # Top-2: each token enters two experts, each scaled by its own score, the outputs summed.
    model_dir, prompts, _ = reference
    top2 = shutil.copytree(model_dir, tmp_path / "top2")
    config = json.loads((top2 / "config.json").read_text())
    (top2 / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 2}))
    expected = hf_greedy(top2, prompts, NEW_TOKENS)
    assert generate(top2, prompts, block_size=4, num_kv_blocks=600) == expected


def test_chunked_prefill_splitting_attention_chunks_matches_transformers(reference):
    model_dir, prompts, expected = reference
    # 13 tokens a step: prefill chunks end inside attention chunks and blocks.
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
    # Each rank: 2 of the 4 query heads, 1 of the 2 KV heads, 48 of the dense layers' 96
    # columns, 24 of every expert's and of the shared expert's 48; the router whole on both.
    model_dir, prompts, expected = reference
    options = dict(block_size=4, num_kv_blocks=200, device="cpu", tensor_parallel_size=2)
    with LLM(str(model_dir), **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def _no_temperature(layer) -> None:  # noqa: ANN001
    layer.self_attn.llama4.temperature = False


def _no_qk_norm(layer) -> None:  # noqa: ANN001
    layer.self_attn.llama4.l2_norm = False


def _no_chunks(layer) -> None:  # noqa: ANN001
    layer.self_attn.mask = {}  # full causal attention


@pytest.mark.parametrize("remove", [_no_temperature, _no_qk_norm, _no_chunks])
def test_without_the_temperature_the_qk_norm_or_the_chunks_the_tokens_differ(reference, remove):
    """What makes the parity above a test of each: this checkpoint's tokens depend on them."""
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    for layer in llm.engine.model.layers:
        remove(layer)
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(got != want for got, want in zip(outs, expected))


# --- the multimodal checkpoint's text model ------------------------------------------------------


def test_a_multimodal_checkpoints_text_model_gives_transformers_tokens(checkpoint_dir):
    import transformers

    model_dir = checkpoint_dir("llama4")
    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    # On text alone the wrapper embeds the tokens and runs its language model; transformers
    # 5.24's wrapper forward then fails reading `image_outputs` from that model's output, so
    # its language model, loaded through the wrapper, generates the reference.
    prompts = random_prompts(6, PROMPT_LENGTHS)
    expected = hf_model_greedy(hf.language_model, prompts, NEW_TOKENS)
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
    reference, tmp_path, change, message
):
    model_dir, _, _ = reference
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
