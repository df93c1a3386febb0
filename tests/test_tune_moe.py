"""The tuner's view of a mixture of experts: memory holds every expert, compute runs the active
ones, and a step reads the experts its tokens touch."""

from __future__ import annotations

import pytest

from pdserve.engine.models.config import ModelConfig
from pdserve.tune.model_shape import PRESETS, ModelShape
from pdserve.tune.roofline import Assumptions, roofline_profile
from pdserve.tune.step_model import StepShape


def test_published_moe_models_count_total_and_active_parameters():
    # Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active; Mixtral 8x7B: 46.7 B, 12.9 B active.
    qwen = PRESETS["qwen3-30b-a3b"]
    assert qwen.num_params / 1e9 == pytest.approx(30.53, abs=0.01)
    active = qwen.active_layers_params + 2 * qwen.embedding_params
    assert active / 1e9 == pytest.approx(3.35, abs=0.01)
    assert qwen.flops_per_token == 2 * qwen.active_layers_params
    mixtral = PRESETS["mixtral-8x7b"]
    assert mixtral.num_params / 1e9 == pytest.approx(46.70, abs=0.01)
    assert (mixtral.active_layers_params + 2 * mixtral.embedding_params) / 1e9 == pytest.approx(
        12.88, abs=0.01
    )


def test_a_config_with_a_shared_expert_and_a_dense_layer_counts_each_part():
    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen2_moe",
            "vocab_size": 100,
            "hidden_size": 16,
            "intermediate_size": 40,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 24,
            "mlp_only_layers": [1],
        }
    )
    shape = ModelShape.from_config(cfg, "tiny")
    attention = 16 * (16 + 2 * 8) + 16 * 16
    dense = attention + 3 * 16 * 40
    fixed = attention + 16 * 5 + 3 * 16 * 24  # attention, router and its shared gate, shared
    expert = 3 * 16 * 8
    assert shape.num_params == dense + 2 * (fixed + 4 * expert) + 2 * 100 * 16
    assert shape.flops_per_token == 2 * (dense + 2 * (fixed + 2 * expert))
    assert shape.expert_weight_bytes("bfloat16") == 2 * 2 * 4 * expert
    assert shape.step_weight_bytes("bfloat16") == 2 * (dense + 2 * fixed + 100 * 16)


def test_a_decode_step_reads_the_experts_its_tokens_touch_and_kv_room_counts_them_all():
    qwen = PRESETS["qwen3-30b-a3b"]
    p = roofline_profile(qwen, "h100", tp_sizes=[1])
    step = p.step
    assert step.experts_touched(1) == pytest.approx(8 / 128)
    assert step.experts_touched(64) == pytest.approx(1 - (120 / 128) ** 64)
    assert step.experts_touched(4096) == pytest.approx(1.0)
    # One decode token reads a sixteenth of the experts; a batch of 64 nearly all of them.
    one, many = StepShape.decode(1, 0), StepShape.decode(64, 0)
    expert_s = step.expert_weights_s
    assert expert_s > 0 and step.weights_s < expert_s  # the experts are most of the bytes
    reads = [
        step.weights_s + expert_s * step.experts_touched(n) + step.per_context_s * n
        for n in (1, 64)
    ]
    assert step.time(one) == pytest.approx(step.base_s + step.per_seq_s + reads[0])
    assert step.time(many) == pytest.approx(step.base_s + 64 * step.per_seq_s + reads[1])
    # The KV pool is what is left after every expert's weights.
    a = Assumptions()
    pool = (80 * a.memory_utilization - a.activation_reserve_gb) * 1e9 - qwen.weight_bytes(
        "bfloat16"
    )
    assert p.kv_blocks == int(pool // qwen.kv_bytes_per_block(16, "bfloat16"))
