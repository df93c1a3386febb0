"""DeepSeek-V2 and V3 from tiny transformers checkpoints (tests/checkpoints.py: V2-Lite's shape
without q_lora_rank, YaRN and softmax routing limited to 2 of 4 expert groups; V3's with
q_lora_rank, sigmoid routing with a correction bias; both a dense first layer and shared
experts): greedy tokens equal transformers' in float32 at two block sizes, with V3's rotary
pairs interleaved or not; tensor-parallel groups equal one rank; preemption, chunked prefill and
prefix-cache hits change nothing; the cache holds one latent per token and layer; the routers
equal transformers' and their group limit does exclude groups; checkpoint refusals name their
field or weight; multi-token-prediction layers are skipped."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from checkpoints import MLA_FAMILIES, hf_greedy
from conftest import FAMILY_NEW_TOKENS, random_prompts
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ModelConfig, UnsupportedModelError
from pdserve.engine.models.moe_router import GroupedRouting, route_grouped

NEW_TOKENS = FAMILY_NEW_TOKENS
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def with_config(src, dst, **changes) -> str:  # noqa: ANN001
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def with_tensors(src, dst, change) -> str:  # noqa: ANN001
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize(("block_size", "cpu_linear"), [(16, "onednn"), (7, "torch")])
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_greedy_tokens_equal_transformers(family_run, family, block_size, cpu_linear):
    model_dir, prompts, expected = family_run(family)
    llm = LLM(
        str(model_dir),
        block_size=block_size,
        num_kv_blocks=1024 // block_size,
        device="cpu",
        cpu_linear=cpu_linear,
    )
    kinds = [type(layer.mlp).__name__ for layer in llm.engine.model.layers]
    assert kinds == ["MLP", "SparseMoE", "SparseMoE"]  # first_k_dense_replace = 1
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_v3_rotary_pairs_not_interleaved_equal_transformers(family_run, tmp_path):
    # rope_interleave false: the rotary rows load as they are, rotated (i, i + d/2)
    model_dir, prompts, _ = family_run("deepseek_v3")
    plain = with_config(model_dir, tmp_path / "plain", rope_interleave=False)
    expected = hf_greedy(plain, prompts, NEW_TOKENS)
    llm = LLM(plain, num_kv_blocks=64, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    _, _, interleaved = family_run("deepseek_v3")
    assert expected != interleaved  # the flag changes the model, so the test could fail


@pytest.mark.parametrize(
    ("family", "size"), [("deepseek_v2", 2), ("deepseek_v3", 2), ("deepseek_v3", 4)]
)
def test_tensor_parallel_groups_equal_one_rank(family_run, family, size):
    # Query heads split (2 or 1 of 4 per rank); the latent, kv_a_proj and q_a_proj whole on
    # every rank; experts and shared experts split by columns.
    model_dir, prompts, expected = family_run(family)
    with LLM(str(model_dir), num_kv_blocks=64, device="cpu", tensor_parallel_size=size) as llm:
        assert llm.engine.layout.num_kv_heads == 1
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


TIGHT = dict(num_kv_blocks=20, block_size=8, max_num_batched_tokens=32, device="cpu")


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_preemption_chunking_and_prefix_hits_change_nothing(family_run, family):
    model_dir, _, _ = family_run(family)
    roomy = LLM(str(model_dir), num_kv_blocks=256, block_size=8, device="cpu")
    tight = LLM(str(model_dir), **TIGHT, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = random_prompts(2, [20, 25, 30, 22]) + random_prompts(3, [100])
    shared = random_prompts(4, [40])[0]
    prompts += [shared + [5 + i] for i in range(2)]
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    steps = tight.engine.stats.num_steps
    got = [o.token_ids for o in tight.generate(prompts[:5], params)]
    got += [o.token_ids for p in prompts[5:] for o in tight.generate([p], params)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.prefix_hits >= 5  # the second shared prompt's 5 blocks
    assert tight.engine.stats.num_steps - steps >= 4  # the 100-token prompt took 4 chunks
    assert tight.engine.block_manager.num_free_blocks == TIGHT["num_kv_blocks"]


def test_the_cache_holds_one_latent_per_token_and_layer(family_run, caplog):
    model_dir, _, _ = family_run("deepseek_v3")
    with caplog.at_level(logging.INFO, logger="pdserve.engine.tp.model_shard"):
        llm = LLM(str(model_dir), num_kv_blocks=32, block_size=16, device="cpu")
    layout = llm.engine.layout
    assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, 32 + 8)
    assert tuple(llm.engine.pool.kv.shape) == (3, 1, 32, 16, 1, 40)
    # 3 layers x 40 floats: a GQA cache of the same heads (4 x (16 + 8) keys, 4 x 24 values)
    # would hold 3 x 192 floats a token.
    assert layout.bytes_per_block // 16 == 3 * 40 * 4
    assert "KV cache: 32 blocks of 16 = 512 tokens, 480 bytes per token" in caplog.text
    assert "a latent of 40 per layer" in caplog.text


def _hidden_router_inputs(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=gen), torch.randn(num_experts, 16, generator=gen)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_grouped_routing_equals_transformers_and_excludes_groups(version):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hidden, weight = _hidden_router_inputs(8, seed=3)
    common = dict(
        hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4
    )
    common |= dict(topk_group=2, routed_scaling_factor=1.7)
    if version == "v2":
        hf = DeepseekV2TopkRouter(DeepseekV2Config(topk_method="group_limited_greedy", **common))
        policy = GroupedRouting(3, False, "softmax", 4, 2, 1.7)
        bias = None
    else:
        hf = DeepseekV3TopkRouter(DeepseekV3Config(norm_topk_prob=True, **common))
        bias = torch.linspace(-0.3, 0.3, 8)
        hf.e_score_correction_bias.copy_(bias)
        policy = GroupedRouting(3, True, "sigmoid", 4, 2, 1.7)
    hf.weight.data.copy_(weight)
    _, hf_weights, hf_ids = hf(hidden)
    logits = hidden @ weight.T
    weights, ids = route_grouped(logits, policy, bias)
    mine = {tuple(sorted(zip(i, w, strict=True))) for i, w in zip(ids.tolist(), weights.tolist())}
    theirs = {
        tuple(sorted(zip(i, w, strict=True))) for i, w in zip(hf_ids.tolist(), hf_weights.tolist())
    }
    assert len(mine) == len(theirs) == 64
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in hf_ids.tolist()]
    order = ids.argsort(dim=-1)
    hf_order = hf_ids.argsort(dim=-1)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    # Without the group limit some token would take another expert: the limit is exercised.
    free = GroupedRouting(3, policy.renormalize, policy.scoring, 1, 1, 1.7)
    _, free_ids = route_grouped(logits, free, bias)
    differs = [sorted(a) != sorted(b) for a, b in zip(ids.tolist(), free_ids.tolist())]
    assert sum(differs) >= 5
    groups = ids // 2
    assert all(len(set(row)) <= 2 for row in groups.tolist())  # at most topk_group groups


def test_the_checkpoints_group_limit_excludes_groups_while_serving(family_run):
    # Each token's experts come from at most 2 of the 4 groups, and for some tokens the best
    # experts overall lie in a third group: the limit changes routing in these checkpoints.
    model_dir, prompts, _ = family_run("deepseek_v3")
    llm = LLM(str(model_dir), num_kv_blocks=64, device="cpu")
    moe = llm.engine.model.layers[1].mlp
    seen = []
    hook = moe.gate.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    hook.remove()
    logits = torch.cat(seen)
    _, ids = route_grouped(logits, moe.grouped, moe.e_score_correction_bias)
    free = GroupedRouting(2, True, "sigmoid", 1, 1, 2.5)
    _, free_ids = route_grouped(logits, free, moe.e_score_correction_bias)
    assert all(len(set(row)) <= 2 for row in (ids // 2).tolist())
    assert any(sorted(a) != sorted(b) for a, b in zip(ids.tolist(), free_ids.tolist()))


def test_the_correction_bias_stays_float32_in_a_bfloat16_model(family_run):
    model_dir, _, _ = family_run("deepseek_v3")
    llm = LLM(str(model_dir), num_kv_blocks=16, device="cpu", dtype="bfloat16")
    moe = llm.engine.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.bfloat16
    assert moe.e_score_correction_bias.dtype == torch.float32
    stored = load_file(model_dir / "model.safetensors")[
        "model.layers.1.mlp.gate.e_score_correction_bias"
    ]
    assert torch.equal(moe.e_score_correction_bias, stored)


REFUSED = [
    ("deepseek_v2", {"norm_topk_prob": True}, "'norm_topk_prob' = true"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "'topk_method' = 'noaux_tc'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "'scoring_func' = 'softmax'"),
    ("deepseek_v3", {"n_group": 3}, "'n_group' = 3"),
    ("deepseek_v3", {"topk_group": 5}, "'topk_group' = 5"),
    ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3}, "'num_experts_per_tok' = 3"),
    (
        "deepseek_v3",
        {
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e5m2",
                "weight_block_size": [8, 8],
            }
        },
        "'quantization_config.fmt' = 'e5m2'",
    ),
    ("deepseek_v3", {"attention_bias": True}, "'attention_bias' = true"),
]


@pytest.mark.parametrize(("family", "change", "message"), REFUSED)
def test_configs_the_engine_cannot_run_are_refused_naming_the_field(
    family_run, family, change, message
):
    model_dir, _, _ = family_run(family)
    cfg = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match=message.replace("(", r"\(")):
        ModelConfig.from_dict({**cfg, **change})


def test_a_missing_or_misshapen_latent_weight_is_refused_by_name(family_run, tmp_path):
    model_dir, _, _ = family_run("deepseek_v3")
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    missing = with_tensors(model_dir, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing weight '{name}'"):
        LLM(missing, num_kv_blocks=16, device="cpu")

    def narrow(tensors):  # noqa: ANN001, ANN202
        tensors[name] = tensors[name][:, :-1].contiguous()

    misshapen = with_tensors(model_dir, tmp_path / "misshapen", narrow)
    with pytest.raises(ValueError, match=f"weight '{name}' has shape"):
        LLM(misshapen, num_kv_blocks=16, device="cpu")


def test_multi_token_prediction_layers_are_skipped(family_run, tmp_path):
    # V3 checkpoints carry their MTP module as layer num_hidden_layers: not loaded.
    model_dir, prompts, expected = family_run("deepseek_v3")

    def add_mtp(tensors):  # noqa: ANN001, ANN202
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(160, 32)

    extended = with_tensors(model_dir, tmp_path / "mtp", add_mtp)
    llm = LLM(extended, num_kv_blocks=64, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_yarn_on_a_llama_checkpoint_equals_transformers(checkpoint_dir, tmp_path):
    # The YaRN frequencies and cos/sin scaling serve every family, not DeepSeek alone.
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    }
    model_dir = with_config(checkpoint_dir("llama"), tmp_path / "yarn", rope_parameters=yarn)
    assert ModelConfig.from_pretrained(model_dir).rotary_attention_factor() > 1.0
    prompts = random_prompts(5, [12, 70])
    expected = hf_greedy(model_dir, prompts, 12)
    llm = LLM(model_dir, num_kv_blocks=64, device="cpu")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
