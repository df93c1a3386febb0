"""The Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against transformers, greedy, in
float32: prompts many blocks long at the smallest block size whose pages hold a linear layer's
state, chunked prefill ending inside blocks, after preemption, a prefix hit that restores a
state snapshot (and differs when the snapshot is read from the wrong block), two
tensor-parallel ranks; and their configs: every field read, what is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.kv.state_pages import LinearStateShape
from pdserve.engine.models.config import ModelConfig, UnsupportedModelError
from pdserve.engine.models.loader import load_model
from pdserve.engine.models.qwen3_next import GatedDeltaNet
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.gated_delta_ref import chunked_gated_delta_rule, gated_delta_step
from pdserve.kernels.ops import select_ops

FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
NEW_TOKENS = 16
# Several prompts in one batch, the longest 14 blocks of 11 tokens.
PROMPT_LENGTHS = [7, 41, 96, 150]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# The prefix-hit prompts: the second shares the first's first 8 blocks (of 11 tokens).
SHARED = 88


def smallest_block(model_dir: Path) -> int:
    """The fewest tokens per block whose pages hold one linear layer's state."""
    return LinearStateShape.for_model(ModelConfig.from_pretrained(model_dir)).min_block_size()


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    """family -> (model dir, prompts, transformers' greedy tokens, block size), made once per
    module; the prompts include the prefix-hit pair last."""
    from checkpoints import hf_greedy

    cache = {}

    def get(family: str):
        if family not in cache:
            model_dir = checkpoint_dir(family)
            prompts = random_prompts(7, PROMPT_LENGTHS)
            first, tail = random_prompts(8, [100, 30])
            prompts += [first, first[:SHARED] + tail]
            expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
            cache[family] = (model_dir, prompts, expected, smallest_block(model_dir))
        return cache[family]

    return get


def generate(model_dir: Path, prompts: list[list[int]], **options: object) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", **options)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_over_many_blocks(reference, family):
    model_dir, prompts, expected, block_size = reference(family)
    assert block_size == 11
    options = dict(block_size=block_size, num_kv_blocks=300)
    assert generate(model_dir, prompts[:4], **options) == expected[:4]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [13, 24])
def test_chunked_prefill_ending_inside_blocks_matches_transformers(reference, family, chunk):
    model_dir, prompts, expected, block_size = reference(family)
    options = dict(block_size=block_size, num_kv_blocks=300, max_num_batched_tokens=chunk)
    assert generate(model_dir, prompts[:4], **options) == expected[:4]


@pytest.mark.parametrize("family", FAMILIES)
def test_preempted_sequences_resume_with_transformers_tokens(reference, family):
    model_dir, prompts, expected, block_size = reference(family)
    llm = LLM(
        str(model_dir),
        block_size=block_size,
        num_kv_blocks=28,
        max_num_batched_tokens=24,
        device="cpu",
    )
    outs = llm.generate(prompts[:4], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected[:4]


def _hit(llm: LLM, prompts: list[list[int]]) -> tuple[list[int], list[int], int]:
    """The first prompt's tokens, then the second's (which shares its prefix) and the tokens
    of that prefix the second found cached."""
    first = llm.generate(prompts[0], GREEDY)[0].token_ids
    bm = llm.engine.block_manager
    hits = bm.prefix_hits
    second = llm.generate(prompts[1], GREEDY)[0].token_ids
    return first, second, (bm.prefix_hits - hits) * bm.block_size


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_hit_restores_the_state_at_its_last_block(reference, family):
    model_dir, prompts, expected, block_size = reference(family)
    llm = LLM(str(model_dir), block_size=block_size, num_kv_blocks=300, device="cpu")
    first, second, cached = _hit(llm, prompts[4:])
    assert cached == SHARED
    assert [first, second] == expected[4:]


def test_a_prefix_hit_reading_the_state_of_an_earlier_block_differs(reference, monkeypatch):
    """What makes the test above one of the snapshot: restored from the block before the
    hit's last (a state 11 tokens old), the second prompt's tokens differ."""
    model_dir, prompts, expected, block_size = reference("qwen3_5_text")
    llm = LLM(str(model_dir), block_size=block_size, num_kv_blocks=300, device="cpu")
    restore = GatedDeltaNet._state_blocks

    def earlier_at_the_hit(tables, seqs, starts, bs):
        shifted = torch.where(starts == SHARED, starts - bs, starts)
        return restore(tables, seqs, shifted, bs)

    llm.generate(prompts[4], GREEDY)
    monkeypatch.setattr(GatedDeltaNet, "_state_blocks", staticmethod(earlier_at_the_hit))
    bm = llm.engine.block_manager
    hits = bm.prefix_hits
    second = llm.generate(prompts[5], GREEDY)[0].token_ids
    assert (bm.prefix_hits - hits) * block_size == SHARED
    assert second != expected[5]


@pytest.mark.cluster  # starts the second rank's process
@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks_match_transformers(reference, family):
    """Each rank holds 1 of the 2 linear key heads, 2 of the 4 value heads, 1 of the 2 KV heads
    (its states laid over it), half of every expert's columns; prefill in chunks."""
    model_dir, prompts, expected, block_size = reference(family)
    options = dict(
        block_size=block_size,
        num_kv_blocks=300,
        max_num_batched_tokens=24,
        device="cpu",
        tensor_parallel_size=2,
    )
    with LLM(str(model_dir), **options) as llm:
        outs = llm.generate(prompts[:4], GREEDY)
        assert [o.token_ids for o in outs] == expected[:4]
        first, second, cached = _hit(llm, prompts[4:])
    assert cached == SHARED
    assert [first, second] == expected[4:]


def test_a_block_size_too_small_for_the_state_is_raised_to_a_multiple_that_holds_it(reference):
    """Asked for blocks of 4, the engine runs blocks of 12 (segments of another length than
    at 11) and gives transformers' tokens."""
    model_dir, prompts, expected, _ = reference("qwen3_5_text")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=300, device="cpu")
    assert llm.engine.layout.block_size == 12
    assert [o.token_ids for o in llm.generate(prompts[:4], GREEDY)] == expected[:4]


def test_a_pool_whose_pages_cannot_hold_the_state_is_refused(reference):
    model_dir, _, _, block_size = reference("qwen3_5_text")
    model = load_model(model_dir, "float32", "cpu")
    layout = KVLayout.for_model(model.config, block_size - 1, "float32")
    pool = KVPool(layout, num_blocks=4)
    groups = layout.groups.num_groups
    one = torch.zeros(1, dtype=torch.long)
    table = torch.zeros(1, 1, dtype=torch.int32)
    batch = AttentionBatch(
        one, table, one + 1, torch.tensor([0, 1]), 1, (one,) * (groups - 1), (table,) * (groups - 1)
    )
    with pytest.raises(ValueError, match="needs blocks of at least 11"):
        model(torch.tensor([5]), one, batch, pool, select_ops("cpu", "auto"))


# --- the delta rule --------------------------------------------------------------------------


def test_the_delta_rule_in_segments_equals_it_whole_and_step_by_step():
    torch.manual_seed(0)
    length, k_heads, v_heads, dim = 70, 2, 4, 8
    q, k = torch.randn(length, k_heads, dim), torch.randn(length, k_heads, dim)
    v = torch.randn(length, v_heads, dim)
    g, beta = -torch.rand(length, v_heads), torch.rand(length, v_heads)
    state = torch.randn(v_heads, dim, dim)
    whole, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
    first, middle = chunked_gated_delta_rule(q[:30], k[:30], v[:30], g[:30], beta[:30], state)
    second, split_final = chunked_gated_delta_rule(
        q[30:], k[30:], v[30:], g[30:], beta[30:], middle
    )
    torch.testing.assert_close(torch.cat([first, second]), whole)
    torch.testing.assert_close(split_final, final)
    steps, stepped = [], state[None]
    for t in range(length):
        out, stepped = gated_delta_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], stepped
        )
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stepped[0], final, rtol=1e-4, atol=1e-4)


# --- config ----------------------------------------------------------------------------------

# A Qwen3-Next config.json as transformers 4.x wrote its releases: rope and partial rotary at
# the top level, no layer_types (a full layer every full_attention_interval).
QWEN3_NEXT_4X = {
    "model_type": "qwen3_next",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 1_000_000.0,
    "rope_scaling": None,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 3,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
    "rms_norm_eps": 1e-5,
    "eos_token_id": 7,
    "mtp_num_hidden_layers": 1,
}


def test_a_qwen3_next_config_is_read_field_by_field():
    cfg = ModelConfig.from_dict(QWEN3_NEXT_4X)
    assert cfg.layer_kinds == ("linear", "linear", "full") * 2
    linear = cfg.linear_attention
    assert (linear.num_k_heads, linear.num_v_heads) == (2, 6)
    assert (linear.head_k_dim, linear.head_v_dim, linear.conv_kernel) == (16, 24, 3)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (32, 8, 1_000_000.0)
    assert cfg.inv_freq().shape == (4,)
    assert cfg.sparse_layers == (1, 5)  # every 2nd layer, but layer 3 (mlp_only_layers)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.shared_expert_intermediate_size == 48 and cfg.shared_expert_gated
    assert cfg.norm_topk_prob  # Qwen3-Next's default
    assert cfg.qk_norm and not cfg.attention_bias and not cfg.o_proj_bias
    assert (cfg.rms_norm_eps, cfg.eos_token_ids, cfg.tie_word_embeddings) == (1e-5, (7,), False)
    no_renorm = ModelConfig.from_dict({**QWEN3_NEXT_4X, "norm_topk_prob": False})
    assert not no_renorm.norm_topk_prob
    biased = ModelConfig.from_dict({**QWEN3_NEXT_4X, "attention_bias": True})
    assert biased.attention_bias and biased.o_proj_bias


def test_qwen3_5_configs_read_their_defaults_rope_parameters_and_wrappers():
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "layer_types": ["linear_attention", "full_attention"] * 2,
    }
    cfg = ModelConfig.from_dict(text)
    assert cfg.layer_kinds == ("linear", "full") * 2 and not cfg.is_moe
    # Qwen3_5TextConfig's defaults: 4 KV heads of 256, linear heads 16 x 128 keys, 32 x 128 values.
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (4, 256, 128, 5000.0)
    assert cfg.linear_attention == dataclasses.replace(
        cfg.linear_attention, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128
    )
    assert cfg.linear_attention.conv_kernel == 4
    wrapper = {
        "model_type": "qwen3_5",
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1},
        "tie_word_embeddings": True,
        "eos_token_id": 9,
    }
    wrapped = ModelConfig.from_dict(wrapper)
    assert wrapped.model_type == "qwen3_5_text"
    assert wrapped.tie_word_embeddings and wrapped.eos_token_ids == (9,)
    assert wrapped.layer_kinds == cfg.layer_kinds
    moe = {
        **text,
        "model_type": "qwen3_5_moe_text",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    }
    for config in (moe, {"model_type": "qwen3_5_moe", "text_config": moe}):
        cfg = ModelConfig.from_dict(config)
        assert cfg.model_type == "qwen3_5_moe_text"
        assert cfg.sparse_layers == (0, 1, 2, 3)  # experts in every layer, renormalised
        assert cfg.norm_topk_prob and cfg.shared_expert_gated
        assert cfg.shared_expert_intermediate_size == 48


REFUSED = {
    "layer_types": (
        {"layer_types": ["linear_attention"] * 5 + ["sliding_attention"]},
        "layer_types",
    ),
    "layer_count": ({"layer_types": ["full_attention"] * 5}, "'layer_types' names 5 layers"),
    "interval": ({"full_attention_interval": 0}, "full_attention_interval"),
    "output_gate": ({"attn_output_gate": False}, "attn_output_gate"),
    "value_heads": ({"linear_num_value_heads": 5}, "linear_num_value_heads"),
    "rotary": ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act"),
    "rope_type": ({"rope_scaling": {"rope_type": "mrope"}}, "rope_type"),
}
QWEN3_5_MOE_REFUSED = {
    "mlp_only_layers": {"mlp_only_layers": [1]},
    "decoder_sparse_step": {"decoder_sparse_step": 2},
    "norm_topk_prob": {"norm_topk_prob": False},
}


@pytest.mark.parametrize(("change", "field"), REFUSED.values(), ids=list(REFUSED))
def test_what_the_engine_cannot_run_is_refused_naming_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict({**QWEN3_NEXT_4X, **change})


@pytest.mark.parametrize("change", QWEN3_5_MOE_REFUSED.values(), ids=list(QWEN3_5_MOE_REFUSED))
def test_qwen3_5_moe_refuses_dense_layers_and_unnormalised_routing(change):
    config = {**QWEN3_NEXT_4X, "model_type": "qwen3_5_moe_text"}
    del config["decoder_sparse_step"], config["mlp_only_layers"]
    config.update(change)
    with pytest.raises(UnsupportedModelError, match=next(iter(change))):
        ModelConfig.from_dict(config)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"linear_num_key_heads": 1, "linear_num_value_heads": 6}, "linear_num_key_heads"),
        (
            {"linear_num_value_heads": 6, "linear_num_key_heads": 2, "num_key_value_heads": 1},
            "num_key_value_heads",
        ),
        ({"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16}, None),
    ],
)
def test_two_ranks_must_split_the_linear_and_kv_heads(change, field):
    cfg = ModelConfig.from_dict({**QWEN3_NEXT_4X, **change})
    if field is None:
        TPShard(0, 2).check(cfg)
        return
    with pytest.raises(ValueError, match=f"'{field}'"):
        TPShard(0, 2).check(cfg)


# --- checkpoints as the releases save them --------------------------------------------------


def test_a_multimodal_qwen3_5_checkpoint_runs_its_language_model(checkpoint_dir):
    """Qwen3_5ForConditionalGeneration's weights (model.language_model.*, a vision tower
    beside it, not loaded) give transformers' tokens for text prompts."""
    from checkpoints import hf_greedy

    model_dir = checkpoint_dir("qwen3_5")
    prompts = random_prompts(9, [5, 60])
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS, "AutoModelForImageTextToText")
    assert generate(model_dir, prompts, block_size=11, num_kv_blocks=100) == expected


def stacked_experts_checkpoint(model_dir: Path, out_dir: Path, num_experts: int) -> Path:
    """model_dir's checkpoint as Qwen3.5-MoE's releases lay it out: each layer's experts
    stacked (gate_up_proj [experts, 2 x width, hidden], down_proj [experts, hidden, width]), the
    text model under model.language_model., and a multi-token-prediction layer (not loaded)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {"mtp.fc.weight": torch.zeros(4, 4)}
    for name in sorted(tensors):
        if ".mlp.experts." in name:
            continue
        new = name.replace("model.", "model.language_model.", 1)
        out[new] = tensors[name]
    layers = {name.split(".")[2] for name in tensors if ".mlp.experts." in name}
    for layer in layers:
        p = f"model.layers.{layer}.mlp.experts."
        expert = [
            {
                proj: tensors[f"{p}{e}.{proj}.weight"]
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
            for e in range(num_experts)
        ]
        stacked = f"model.language_model.layers.{layer}.mlp.experts."
        out[stacked + "gate_up_proj"] = torch.stack(
            [torch.cat([e["gate_proj"], e["up_proj"]]) for e in expert]
        )
        out[stacked + "down_proj"] = torch.stack([e["down_proj"] for e in expert])
    out_dir.mkdir()
    save_file(out, str(out_dir / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out_dir / name)
    return out_dir


@pytest.mark.parametrize("tensor_parallel_size", [1, pytest.param(2, marks=pytest.mark.cluster)])
def test_stacked_experts_load_as_per_expert_ones(reference, tmp_path, tensor_parallel_size):
    model_dir, prompts, expected, block_size = reference("qwen3_5_moe_text")
    stacked = stacked_experts_checkpoint(model_dir, tmp_path / "stacked", num_experts=4)
    options = dict(block_size=block_size, num_kv_blocks=300, device="cpu")
    with LLM(str(stacked), tensor_parallel_size=tensor_parallel_size, **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts[:4], GREEDY)] == expected[:4]
