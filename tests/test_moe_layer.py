"""The mixture-of-experts pieces alone: the router against hand-computed cases and transformers'
routers, the torch reference MoE against a token-by-token loop, the shared expert's gate, the
config fields that choose sparse and dense layers, and what loading refuses."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from pdserve.engine.models.config import ModelConfig, UnsupportedModelError
from pdserve.engine.models.moe_router import route
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels import moe_ref
from pdserve.kernels.ops import REFERENCE

# --- the router ------------------------------------------------------------------------------


def test_the_router_keeps_the_k_most_probable_experts_with_their_softmax_weights():
    # Probabilities 1/7, 2/7, 3/7, 1/7: experts 2 and 1, with 3/7 and 2/7.
    logits = torch.tensor([[0.0, math.log(2), math.log(3), 0.0]])
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(weights, torch.tensor([[3 / 7, 2 / 7]]))
    assert weights.dtype == torch.float32


def test_renormalising_makes_the_k_weights_sum_to_one():
    logits = torch.tensor([[0.0, math.log(2), math.log(3), 0.0]])
    weights, ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.6, 0.4]]))
    weights, _ = route(logits, 4, renormalize=True)
    torch.testing.assert_close(weights, torch.tensor([[3 / 7, 2 / 7, 1 / 7, 1 / 7]]))


def test_half_precision_logits_route_in_float32():
    logits = torch.tensor([[0.0, math.log(2), math.log(3), 0.0]], dtype=torch.bfloat16)
    weights, _ = route(logits, 2, renormalize=False)
    assert weights.dtype == torch.float32


def test_ties_route_as_transformers_routes_them():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    # Three-way, two-way and four-way ties among the largest, and a tie below the k-th.
    hidden = torch.eye(4)
    router_weight = torch.tensor(
        [[1.0, 0.0, 3.0, 2.0], [1.0, 2.0, 3.0, 1.0], [1.0, 2.0, 3.0, 0.0], [0.0, 2.0, 3.0, 1.0]]
    )  # logits of token t: column t
    logits = hidden @ router_weight.T
    size = dict(hidden_size=4, num_experts_per_tok=2)
    theirs = {}
    for renormalize, router in (
        (True, MixtralTopKRouter(MixtralConfig(num_local_experts=4, **size))),
        (False, Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=4, norm_topk_prob=False, **size))),
    ):
        with torch.no_grad():
            router.weight.copy_(router_weight)
            _, scores, indices = router(hidden)
        weights, ids = route(logits, 2, renormalize)
        assert torch.equal(ids, indices)
        torch.testing.assert_close(weights, scores.float())
        theirs[renormalize] = ids
    # Token 0's logits are 1, 1, 1, 0: a tie of three for two places, and both pick the same two.
    assert len(set(theirs[True][0].tolist()) & {0, 1, 2}) == 2
    # Renormalised, tied experts share the weight equally.
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], torch.tensor([0.5, 0.5]))


# --- the reference MoE -----------------------------------------------------------------------


def token_by_token(hidden, w13, w2, weights, ids):  # noqa: ANN001, ANN201
    """Each token through each of its experts, one at a time."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    width = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = w13[e, :width].double() @ x, w13[e, width:].double() @ x
            out[t] += float(weights[t, slot]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def test_the_reference_equals_running_each_token_through_its_experts():
    torch.manual_seed(0)
    num_tokens, hidden_size, width, num_experts = 9, 12, 10, 6
    hidden = torch.randn(num_tokens, hidden_size)
    w13 = torch.randn(num_experts, 2 * width, hidden_size) * 0.3
    w2 = torch.randn(num_experts, hidden_size, width) * 0.3
    # Experts 1 and 4 receive no token; expert 3 several, in both slots.
    ids = torch.tensor([[0, 3], [3, 5], [2, 0], [5, 3], [3, 2], [0, 5], [2, 3], [3, 0], [5, 2]])
    weights = torch.rand(num_tokens, 2)
    out = moe_ref.fused_moe(hidden, w13, w2, weights, ids)
    assert out.dtype == hidden.dtype
    expected = token_by_token(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)  # float32 vs 64
    # No tokens, no work.
    empty = moe_ref.fused_moe(hidden[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, hidden_size)


def test_the_shared_expert_is_scaled_by_its_sigmoid_gate():
    from pdserve.engine.models.llama import MLP
    from pdserve.engine.models.moe import SparseMoE

    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen2_moe",
            "vocab_size": 8,
            "hidden_size": 2,
            "intermediate_size": 4,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 1,
            "shared_expert_intermediate_size": 1,
        }
    )
    moe = SparseMoE(cfg, TPShard(), None, MLP)
    with torch.no_grad():
        for p in moe.parameters():
            p.zero_()  # routed experts contribute nothing
        moe.shared_expert.gate_up_proj.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        moe.shared_expert.down_proj.weight.copy_(torch.tensor([[1.0], [0.0]]))
        x = torch.tensor([[1.0, 2.0]])
        # gate 0: sigmoid 1/2 of silu(1) * 2
        out = moe(x, REFERENCE)
        torch.testing.assert_close(out, torch.tensor([[0.5 * 2 * F.silu(torch.tensor(1.0)), 0.0]]))
        moe.shared_expert_gate.weight.copy_(torch.tensor([[math.log(3), 0.0]]))  # sigmoid 3/4
        out = moe(x, REFERENCE)
        torch.testing.assert_close(out, torch.tensor([[0.75 * 2 * F.silu(torch.tensor(1.0)), 0.0]]))


# --- the config --------------------------------------------------------------------------------

BASE = {
    "vocab_size": 8,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_mixtral_experts_are_as_wide_as_its_intermediate_size_and_always_renormalised():
    cfg = ModelConfig.from_dict(
        {**BASE, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    )
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and cfg.sparse_layers == tuple(range(6))
    assert not cfg.attention_bias and not cfg.qk_norm


def test_decoder_sparse_step_and_mlp_only_layers_choose_the_sparse_layers():
    qwen3 = {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 8}
    assert ModelConfig.from_dict(qwen3).sparse_layers == (0, 1, 2, 3, 4, 5)
    cfg = ModelConfig.from_dict({**qwen3, "decoder_sparse_step": 2})
    assert cfg.sparse_layers == (1, 3, 5)
    cfg = ModelConfig.from_dict({**qwen3, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.sparse_layers == (1, 5)
    assert cfg.qk_norm and not cfg.norm_topk_prob
    assert ModelConfig.from_dict({**qwen3, "norm_topk_prob": True}).norm_topk_prob
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    alias = {**qwen3, "num_local_experts": 4}
    del alias["num_experts"]
    assert ModelConfig.from_dict(alias).num_experts == 4
    dense = ModelConfig.from_dict({**qwen3, "mlp_only_layers": list(range(6))})
    assert not dense.is_moe and dense.num_experts == 0


def test_qwen2_moe_reads_its_shared_expert_and_qkv_bias():
    cfg = ModelConfig.from_dict(
        {
            **BASE,
            "model_type": "qwen2_moe",
            "num_experts": 4,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 24,
        }
    )
    assert cfg.shared_expert_intermediate_size == 24
    assert cfg.attention_bias and not cfg.o_proj_bias


def test_configs_the_engine_cannot_run_are_refused_naming_the_field():
    cfg = {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 8}
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**cfg, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="'moe_intermediate_size' = 8 is not divisible"):
        TPShard(0, 16).check(ModelConfig.from_dict({**cfg, "num_attention_heads": 16}))
    with pytest.raises(ValueError, match="'intermediate_size' = 12 is not divisible"):
        TPShard(0, 8).check(
            ModelConfig.from_dict(
                {**BASE, "model_type": "mixtral", "intermediate_size": 12, "num_attention_heads": 8}
            )
        )
