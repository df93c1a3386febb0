"""Gemma 4 from transformers' own tiny checkpoints: an E-shaped one (full layers' heads twice as
wide as the sliding ones', the last 3 of 7 layers reading earlier layers' KV with double-wide
MLPs, per-layer embeddings, proportional rope) and a 31B/26B-shaped one (fewer, wider KV heads on
the full layers, keys and values of one projection, experts beside every MLP). Greedy tokens
equal transformers' in float32 with prompts several windows long, at block sizes that do and do
not divide the window, with chunked prefill, a prefix-cache hit, after preemption and at TP=2; a
multimodal checkpoint's text model equals Gemma4ForConditionalGeneration on text; the pool holds
both page shapes in lanes and no page of a KV-sharing layer; the released configs' shapes read
as documented; what pdserve cannot run is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import hf_greedy
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.models.config import ModelConfig, UnsupportedModelError
from pdserve.engine.tp.shard import TPShard

NEW_TOKENS = 24
WINDOW = 8
# Several windows long; 70 takes the CPU attention's SDPA prefill path (64 query tokens or more).
PROMPT_LENGTHS = [3, 13, 30, 70]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
HF_CLASS = {
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4_moe": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
}
TEXT_FAMILIES = ["gemma4_text", "gemma4_moe"]


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


def generate(model_dir, prompts, **engine) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", **{"num_kv_blocks": 600, **engine})
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# --- the KV pool -------------------------------------------------------------------------------


def test_an_e_shaped_checkpoint_keeps_kv_of_its_first_layers_only(reference):
    """Layers 4..6 read layers 3 (sliding) and 2 (full): the pool has pages for 4 layers, the
    sliding ones two to a slot (their pages are half the full layer's)."""
    model_dir, _, _ = reference("gemma4_text")
    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.kv_donors == (0, 1, 2, 3, 3, 2, 2) and cfg.num_cache_layers == 4
    assert cfg.gemma4.mlp_widths == (64,) * 4 + (128,) * 3
    layout = KVLayout.for_model(cfg, 4, "float32")
    assert layout.num_layers == 4
    assert layout.layer_shapes == ((2, 16), (2, 16), (2, 32), (2, 16))
    groups = layout.groups
    assert [g.layers for g in groups.groups] == [(2,), (0, 1), (3,)]
    assert groups.lanes_of == (2, 2, 1, 2) and groups.lane_of == (0, 1, 0, 0)
    assert [groups.fill(g) for g in range(3)] == [1.0, 1.0, 0.5]
    # One slot of 2 heads x 32 for K and V: what the 4 layers keeping KV need, no more.
    assert layout.bytes_per_block == 1 * 2 * 4 * 2 * 32 * 4


def test_a_31b_shaped_checkpoint_puts_two_full_layers_in_a_slot(reference):
    model_dir, _, _ = reference("gemma4_moe")
    cfg = ModelConfig.from_pretrained(model_dir)
    layout = KVLayout.for_model(cfg, 4, "float32")
    assert layout.layer_shapes == ((8, 8), (8, 8), (2, 16)) * 2
    groups = layout.groups
    assert groups.groups[0].layers == (2, 5) and groups.num_groups == 5
    assert [groups.fill(g) for g in range(5)] == [1.0] * 5
    assert cfg.gemma4.k_eq_v_layers == (False, False, True) * 2


def test_layers_in_lanes_of_one_slot_keep_their_own_pages():
    """Layers 1 and 2 have pages half layer 0's: they share a slot, each block's page of one
    apart from the other's, both ordinary contiguous pages the kernels read."""
    layout = KVLayout(3, 4, 2, 8, "float32", 2, ("full",) * 3, ((2, 8), (2, 4), (2, 4)))
    assert layout.groups.lanes_of == (1, 2, 2) and layout.num_slots == 1
    pool = KVPool(layout, 3)
    a, b = pool.layer_pages(1), pool.layer_pages(2)
    assert a.planes[0].shape == (6, 4, 2, 4) and a.planes[0].is_contiguous()
    tables = torch.tensor([[2, 0, -1]], dtype=torch.int32)
    assert a.tables(tables).tolist() == [[4, 0, -2]] and b.tables(tables).tolist() == [[5, 1, -1]]
    slots = torch.tensor([9, -1])  # block 2, offset 1; a padding token
    assert a.slots(slots).tolist() == [17, -5] and b.slots(slots).tolist() == [21, -1]
    a.planes[0].view(-1, 2, 4)[17] = 1.0
    b.planes[0].view(-1, 2, 4)[21] = 2.0
    assert pool.kv[0, 0, 2].sum() == 8 * 1.0 + 8 * 2.0  # both in block 2, apart
    with pytest.raises(ValueError, match="largest"):
        KVLayout(2, 4, 2, 8, "float32", 2, ("full",) * 2, ((2, 4), (2, 4)))


def test_kv_sharing_layers_own_no_pages_and_every_block_comes_back(reference):
    model_dir, prompts, expected = reference("gemma4_text")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    engine = llm.engine
    # One slot of the 4 layers keeping KV; three block tables a sequence, none for layers 4..6.
    assert tuple(engine.pool.kv.shape) == (1, 2, 600, 4, 2, 32)
    assert engine.scheduler.kv.num_groups == 3
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_the_unused_kv_projections_of_sharing_layers_are_skipped(reference, tmp_path):
    """Checkpoints may hold k/v projections and norms of the KV-sharing layers, which
    transformers does not load either; any other stray weight is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, prompts, expected = reference("gemma4_text")
    copy = tmp_path / "with_unused"
    shutil.copytree(model_dir, copy)
    weights = load_file(copy / "model.safetensors")
    for layer in (4, 5, 6):
        for name in ("k_proj", "v_proj"):
            weights[f"model.layers.{layer}.self_attn.{name}.weight"] = torch.zeros(64, 48)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert generate(copy, prompts[:2], block_size=4) == expected[:2]
    weights["model.layers.3.self_attn.sinks"] = torch.zeros(4)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.3.self_attn.sinks'"):
        LLM(str(copy), num_kv_blocks=16, device="cpu")


# --- greedy tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", TEXT_FAMILIES)
@pytest.mark.parametrize("block_size", [4, 5])
def test_greedy_matches_transformers_at_block_sizes_that_do_and_do_not_divide_the_window(
    reference, family, block_size
):
    model_dir, prompts, expected = reference(family)
    assert generate(model_dir, prompts, block_size=block_size) == expected


def test_the_torch_reference_kernels_and_unpacked_experts_give_transformers_tokens(reference):
    """What a GPU node without Triton runs: the torch attention reference, the experts on their
    stacked weights (CPU nodes pack them for oneDNN)."""
    model_dir, prompts, expected = reference("gemma4_moe")
    llm = LLM(
        str(model_dir),
        block_size=4,
        num_kv_blocks=600,
        device="cpu",
        kernel_backend="torch",
        cpu_linear="torch",
    )
    assert llm.engine.ops.name == "torch"
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_chunked_prefill_splitting_windows_matches_transformers(reference, family):
    model_dir, prompts, expected = reference(family)
    # 11 tokens a step: chunks end inside windows and blocks.
    assert generate(model_dir, prompts, block_size=4, max_num_batched_tokens=11) == expected


def test_a_prefix_hit_gives_the_same_tokens(reference):
    model_dir, prompts, expected = reference("gemma4_text")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_sequences_resume_with_transformers_tokens(reference):
    model_dir, prompts, expected = reference("gemma4_text")
    llm = LLM(
        str(model_dir), block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, device="cpu"
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_multimodal_checkpoints_text_model_matches_conditional_generation(reference):
    model_dir, prompts, expected = reference("gemma4")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "gemma4" and "vision_config" in cfg
    assert generate(model_dir, prompts, block_size=5) == expected


def test_placeholder_tokens_are_embedded_as_padding_as_the_multimodal_model_does(checkpoint_dir):
    """On text, Gemma4ForConditionalGeneration embeds its image, video and audio tokens (7, 8
    and 9 here) as pad_token_id, in both embeddings."""
    model_dir = checkpoint_dir("gemma4")
    prompts = [p[:5] + [7, 8, 9] + p[5:] for p in random_prompts(6, [12, 30])]
    expected = hf_greedy(model_dir, prompts, 12, "Gemma4ForConditionalGeneration")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=200, device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_capped_logits_give_transformers_logprobs(reference):
    """The cap (tanh) keeps the argmax: log-probabilities are what test it."""
    import transformers

    model_dir, prompts, expected = reference("gemma4_text")
    model = transformers.Gemma4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompts[2] + expected[2]])
    scored = slice(len(prompts[2]) - 1, -1)
    with torch.no_grad():
        logits = model(ids).logits[0, scored]
    hf = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(expected[2])[:, None])
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([prompts[2]], params)
    assert out.token_ids == expected[2]
    ours = torch.tensor([lp["token"][1] for lp in out.logprobs])
    torch.testing.assert_close(ours, hf[:, 0], rtol=0, atol=1e-4)


def test_padded_decode_steps_generate_the_same_tokens(checkpoint_dir):
    """Decode steps through the CUDA-graph path's static, padded inputs (run eagerly on CPU):
    padding rows' slots and tables pass through every lane's mapping untouched."""
    from test_decode_graphs import make_engine, run_workload

    options = dict(model=str(checkpoint_dir("gemma4_text")))
    expected = run_workload(make_engine(None, **options))
    engine = make_engine(8, **options)
    assert len(engine.runner.decode_graphs.inputs.tables) == 3
    assert run_workload(engine) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.cluster
def test_tensor_parallel_greedy_tokens_equal_transformers(reference):
    """(The 31B-shaped checkpoint runs at TP=2 in a cluster below.)"""
    model_dir, prompts, expected = reference("gemma4_text")
    with LLM(
        str(model_dir), block_size=4, num_kv_blocks=600, device="cpu", tensor_parallel_size=2
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


# --- configs -----------------------------------------------------------------------------------

# The released checkpoints' text shapes, as their model cards and configs document them (layers
# 5 sliding to 1 full; the full layers' heads 512 wide).
GEMMA4_31B = {
    "model_type": "gemma4_text",
    "num_hidden_layers": 60,
    "hidden_size": 5376,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 4,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "hidden_size_per_layer_input": 0,
    "final_logit_softcapping": 30.0,
}
GEMMA4_E4B = {
    "model_type": "gemma4_text",
    "num_hidden_layers": 42,
    "hidden_size": 2560,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 512,
    "num_kv_shared_layers": 18,
    "hidden_size_per_layer_input": 256,
}


def test_the_31b_shape_wastes_no_byte_of_a_block():
    cfg = ModelConfig.from_dict(GEMMA4_31B)
    layout = KVLayout.for_model(cfg, 16, "bfloat16")
    groups = layout.groups
    # Ten full layers (4 heads x 512) two to a slot; fifty sliding (16 x 256) in groups of 5.
    assert groups.groups[0].layers == tuple(range(5, 60, 6)) and layout.num_slots == 5
    assert groups.num_groups == 11 and all(groups.fill(g) == 1.0 for g in range(11))
    assert (layout.num_kv_heads, layout.head_dim) == (16, 256)


def test_the_e4b_shape_keeps_kv_of_24_layers_and_fills_its_full_group():
    cfg = ModelConfig.from_dict(GEMMA4_E4B)
    assert cfg.num_cache_layers == 24
    # Each KV-sharing layer reads the last of the first 24 of its type: 22 (sliding), 23 (full).
    assert set(cfg.kv_donors[24:]) == {22, 23}
    groups = KVLayout.for_model(cfg, 16, "bfloat16").groups
    # 4 full layers (2 x 512) fill 4 slots; 20 sliding (2 x 256) two to a slot, 8 a group.
    assert [len(g.layers) for g in groups.groups] == [4, 8, 8, 4]
    assert [groups.fill(g) for g in range(4)] == [1.0, 1.0, 1.0, 0.5]


def test_tensor_parallelism_refuses_to_replicate_some_layers_kv_heads():
    cfg = ModelConfig.from_dict(GEMMA4_31B)
    TPShard(0, 4).check(cfg)
    with pytest.raises(ValueError, match="4 KV heads"):
        TPShard(0, 8).check(cfg)


def test_unequal_tensor_parallel_nodes_cannot_exchange_pages_of_unequal_shapes():
    from pdserve.kv_transfer.sharded import ShardedSender

    layout = KVLayout.for_model(ModelConfig.from_dict(GEMMA4_31B), 16, "bfloat16")
    sender = ShardedSender("tcp", None, None, [(0, 8), (8, 16)], layout)
    receiver = {"layout": layout.to_dict(), "tp_ranks": [{"kv_heads": [0, 16]}]}
    with pytest.raises(ValueError, match="equal tensor-parallel sizes"):
        sender.connect("decode-0", receiver)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"per_layer_config": {"2": {"sliding_window": 4}}}, "per_layer_config.2.sliding_window"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0}}},
            "rope_parameters.sliding_attention.rope_type",
        ),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_what_pdserve_cannot_run_is_refused_by_name(reference, change, field):
    model_dir, _, _ = reference("gemma4_text")
    cfg = {**json.loads((model_dir / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(cfg)


# --- served disaggregated ----------------------------------------------------------------------

CLUSTER_BLOCK_SIZE = 8
# Windowed KV groups of each text checkpoint (besides one full-attention group).
WINDOWED_GROUPS = {"gemma4_text": 2, "gemma4_moe": 4}
# (family, transport, tensor-parallel size of both nodes, layer-wise streaming)
CLUSTER_CASES = [("gemma4_moe", "tcp", 2, False), ("gemma4_text", "shm", 1, True)]


def blocks_moved(prompt_len: int, family: str) -> int:
    """Blocks a handoff of this prompt moves: the full group's every block; each windowed
    group's from the one holding the first token the decode node's first query reads. The
    KV-sharing layers have none."""
    whole = -(-prompt_len // CLUSTER_BLOCK_SIZE)
    last = whole - max(0, prompt_len - WINDOW + 1) // CLUSTER_BLOCK_SIZE
    return whole + WINDOWED_GROUPS[family] * last


@pytest.mark.cluster
@pytest.mark.parametrize(
    "family, transport, tp, streaming",
    CLUSTER_CASES,
    ids=[f"{f}-{t}-tp{n}{'-streaming' if s else ''}" for f, t, n, s in CLUSTER_CASES],
)
def test_a_prefill_node_hands_off_to_a_decode_node_the_offline_tokens(
    checkpoint_dir, family, transport, tp, streaming
):
    """Pages of both shapes move whole, lanes with their slots, between nodes of equal
    tensor-parallel sizes; the decode node receives the full group's blocks and the windows'."""
    import asyncio

    from local_cluster import Cluster
    from test_cluster import make_prompts
    from test_tp_cluster import complete_all

    from pdserve.coordinator.config import CoordinatorConfig

    model = str(checkpoint_dir(family))
    offline = LLM(model, num_kv_blocks=1024, block_size=CLUSTER_BLOCK_SIZE, device="cpu")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = make_prompts(6, seed=41, lo=20, hi=90)
    expected = [o.token_ids for o in offline.generate(prompts, params)]
    config = CoordinatorConfig(
        heartbeat_timeout_s=3.0,
        transfer_timeout_s=10.0,
        kv_streaming=streaming,
        kv_streaming_min_prompt_tokens=24,
    )
    with Cluster(
        1,
        1,
        transport=transport,
        model=model,
        config=config,
        node_engines={node: {"tensor_parallel_size": tp} for node in ("prefill-0", "decode-0")},
        num_kv_blocks=160,
        block_size=CLUSTER_BLOCK_SIZE,
        max_num_batched_tokens=32,  # prompts over 32 tokens prefill in chunks
    ) as cluster:
        assert asyncio.run(complete_all(cluster.client_addr, prompts, params)) == expected
        cluster.wait_until_idle()
        moved = sum(blocks_moved(len(p), family) for p in prompts)
        node = cluster.wait_for_report(
            "decode-0", lambda n: n.kv_blocks_received >= moved, f"{moved} blocks received"
        )
        assert node.kv_blocks_received == moved
