"""The tuner's view of models whose layers keep different state (sliding windows, chunked local
attention beside full attention): the shape carries each layer's kind from config.json, a long
prompt costs per token the KV of its full layers only, and the bytes a handoff moves, the blocks
a sequence holds and the conversations a node's pool holds are what the KV manager says, not
the all-full model's."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.kv_manager import KVCacheManager, handoff_blocks
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.sequence import Sequence
from pdserve.tune.deployment import Deployment
from pdserve.tune.model_shape import ModelShape
from pdserve.tune.profile import Profile
from pdserve.tune.roofline import Assumptions, roofline_profile, roofline_step
from pdserve.tune.simulator import Simulation
from pdserve.tune.step_model import StepShape, StepTimeModel
from pdserve.tune.transfer_model import TransferModel
from pdserve.tune.workload import SimRequest

# gpt-oss-20b's attention (24 layers alternating sliding 128 / full, 8 KV heads of 64) on a
# dense stand-in of its size: the KV is what these tests read.
OSS = ModelShape(
    "gpt-oss-20b-like",
    24,
    2880,
    2880 * 4,
    64,
    8,
    64,
    201088,
    131072,
    layer_kinds=tuple("sliding 128" if (i + 1) % 2 else "full" for i in range(24)),
)
OSS_FULL = replace(OSS, name="all-full", layer_kinds=())
PROMPT = 8192


def arrive(shape: ModelShape, kv: KVCacheManager, n: int, name: str = "r") -> Sequence | None:
    """A sequence whose n prompt tokens' KV arrive by handoff, as a decode node reserves it."""
    seq = Sequence(name, list(range(n)) + [0], SamplingParams(max_tokens=10, ignore_eos=True))
    seq.num_computed_tokens = n
    return seq if kv.allocate_arriving(seq, n, 0) else None


def test_the_shape_carries_each_layers_kind_from_the_config():
    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "max_position_embeddings": 512,
            "use_sliding_window": True,
            "sliding_window": 12,
            "max_window_layers": 1,
        }
    )
    shape = ModelShape.from_config(cfg, "qwen2-sliding")
    assert shape.layer_kinds == cfg.layer_kinds == ("full", "sliding 12", "sliding 12")
    assert shape.kv_layout(8, "float32") == KVLayout.for_model(cfg, 8, "float32")
    again = ModelShape.from_dict(json.loads(json.dumps(shape.to_dict())))
    assert again == shape and again.same_shape(shape)
    assert shape.num_full_layers == 1
    assert not shape.same_shape(replace(shape, layer_kinds=()))


def test_a_long_prompt_costs_per_token_the_kv_of_its_full_layers():
    per_layer = 2 * 8 * 64 * 2  # K and V, 8 heads of 64, bf16
    assert OSS_FULL.kv_bytes_per_token("bfloat16") == 24 * per_layer
    assert OSS.kv_bytes_per_token("bfloat16") == 12 * per_layer
    assert OSS.kv_window_bytes("bfloat16") == 12 * 128 * per_layer
    assert OSS_FULL.kv_window_bytes("bfloat16") == 0
    # A block of the pool holds a page of each slot: 12 (two groups of 12 layers) or 24.
    assert OSS.kv_bytes_per_block(16, "bfloat16") == 16 * 12 * per_layer
    assert OSS.kv_bytes_per_block(16, "bfloat16") == OSS.kv_layout(16, "bfloat16").bytes_per_block


@pytest.mark.parametrize("tokens", [1, 100, 128, 129, PROMPT, PROMPT + 5, 32768])
def test_handoff_bytes_are_the_blocks_the_kv_manager_moves(tokens):
    for shape in (OSS, OSS_FULL):
        layout = shape.kv_layout(16, "bfloat16")
        kv = KVCacheManager(BlockManager(4096, 16), layout.groups)
        seq = arrive(shape, kv, tokens)
        moved = len(handoff_blocks(seq.block_tables, 0)) * layout.bytes_per_block
        assert shape.kv_handoff_bytes(tokens, 16, "bfloat16") == moved
    full = OSS_FULL.kv_handoff_bytes(tokens, 16, "bfloat16")
    assert full == -(-tokens // 16) * OSS_FULL.kv_bytes_per_block(16, "bfloat16")
    if tokens >= 128 + 16:  # a block past the window the sliding layers move its last ones only
        assert OSS.kv_handoff_bytes(tokens, 16, "bfloat16") < full
    if tokens == PROMPT:  # the full group's 512 blocks and the window's 8, of half the layers
        assert OSS.kv_handoff_bytes(tokens, 16, "bfloat16") * 512 == full * 520 // 2


def test_a_nodes_pool_holds_the_conversations_the_kv_manager_admits():
    # The same memory: the hybrid pool's blocks are half the size, and an 8k conversation
    # takes 520 of them (512 full, 8 of the window) against 512 of twice the size.
    profiles = {s.name: roofline_profile(s, "h100", tp_sizes=[1]) for s in (OSS, OSS_FULL)}
    hybrid, full = profiles[OSS.name], profiles[OSS_FULL.name]
    a = Assumptions()
    budget = (80 * a.memory_utilization - a.activation_reserve_gb) * 1e9
    for shape, p in ((OSS, hybrid), (OSS_FULL, full)):
        weights = shape.weight_bytes("bfloat16")
        assert p.kv_blocks == int((budget - weights) // shape.kv_bytes_per_block(16, "bfloat16"))
    assert hybrid.kv_blocks == 2 * full.kv_blocks or hybrid.kv_blocks == 2 * full.kv_blocks + 1
    counted = {}
    for shape, p in ((OSS, hybrid), (OSS_FULL, full)):
        kv = KVCacheManager(BlockManager(p.kv_blocks, 16), shape.kv_groups)
        admitted = 0
        while arrive(shape, kv, PROMPT, f"c{admitted}") is not None:
            admitted += 1
        # What the tuner counts a sequence (peak_blocks: a decoding window's one more block)
        # never admits more than the KV manager does.
        tuner = p.kv_blocks // shape.kv_blocks_held(PROMPT, 16)
        assert tuner <= admitted <= p.kv_blocks // (PROMPT // 16)
        counted[shape.name] = admitted
    assert counted[OSS_FULL.name] == full.kv_blocks // 512
    assert counted[OSS.name] == hybrid.kv_blocks // 520
    assert counted[OSS.name] > 1.9 * counted[OSS_FULL.name]


def test_a_decode_step_reads_the_full_layers_context_and_each_window_once():
    step = roofline_step(OSS, "bfloat16", 1e6, 1.0, 0.0, 0.0)  # 1 GB/s, compute free
    full_step = roofline_step(OSS_FULL, "bfloat16", 1e6, 1.0, 0.0, 0.0)
    assert step.per_context_s == pytest.approx(full_step.per_context_s / 2)
    assert step.per_seq_s == pytest.approx(OSS.kv_window_bytes("bfloat16") / 1e9)
    # At a 32k context one sequence's decode reads less than half the all-full model's KV.
    at_32k = StepShape.decode(1, 32768)
    kv_32k = StepTimeModel(per_context_s=full_step.per_context_s).time(at_32k)
    assert step.time(at_32k) - step.weights_s < 0.51 * kv_32k


def test_a_simulated_handoff_moves_the_windowed_groups_last_blocks_only():
    # Two layers, one sliding 8 and one full (two groups of one): a 64-token prompt moves the
    # full group's 4 blocks and the window's last one, blocks of one layer's pages.
    shape = ModelShape(
        "windowed", 2, 64, 192, 4, 2, 16, 512, 2048, layer_kinds=("sliding 8", "full")
    )
    hop, step_s = 0.001, 0.010
    p = Profile(
        shape,
        "float32",
        StepTimeModel(base_s=step_s),
        TransferModel(latency_s=0.002, bytes_per_s=1e9),
        kv_blocks=256,
        hop_s=hop,
    )
    prompt, outputs = 64, 6
    sim = Simulation(Deployment(1, 1), p)
    result = sim.run([SimRequest(0.0, prompt, outputs)], None)
    (outcome,) = result.outcomes
    assert p.kv_bytes_per_block == 16 * 2 * 2 * 16 * 4  # one slot: K and V of 2 heads of 16
    moved = shape.kv_handoff_bytes(prompt, 16, "float32")
    assert moved == 5 * p.kv_bytes_per_block
    transfer = p.transfer.latency_s + moved / p.transfer.bytes_per_s
    second_gap = 3 * hop + transfer + step_s + hop
    expected = (second_gap + (outputs - 2) * step_s) / (outputs - 1)
    assert outcome.tpot_s == pytest.approx(expected, rel=1e-12)
