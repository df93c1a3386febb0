"""The tuner's view of multi-head latent attention (DeepSeek-V2 and V3): parameters as published,
one latent a token and layer in the cache, the absorbed form's FLOPs as torch counts them, and a
tensor-parallel group that splits the heads but holds the latent whole on every GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.models.config import ModelConfig
from pdserve.tune.deployment import Deployment
from pdserve.tune.model_shape import DTYPE_BYTES, PRESETS, ModelShape
from pdserve.tune.roofline import DEVICES, Assumptions, roofline_profile, roofline_step
from pdserve.tune.simulator import Simulation
from pdserve.tune.step_model import StepShape
from pdserve.tune.workload import SimRequest

V3 = PRESETS["deepseek-v3"]
V2_LITE = PRESETS["deepseek-v2-lite"]
LLAMA_70B = PRESETS["llama3-70b"]
# Llama-3.1-405B's published shape: the GQA model nearest DeepSeek-V3's size (no preset).
LLAMA_405B = ModelShape("Llama-3.1-405B", 126, 16384, 53248, 128, 8, 128, 128256, 131072)
# DeepSeek-V2 (236 B, 21 B active): no preset, a third check of how DeepSeek counts.
V2 = ModelShape(
    "DeepSeek-V2",
    60,
    5120,
    12288,
    128,
    128,
    64,
    102400,
    163840,
    num_sparse_layers=59,
    num_experts=160,
    experts_per_token=6,
    moe_intermediate_size=1536,
    shared_expert_intermediate_size=3072,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    v_head_dim=128,
)

# The published config.json files, V3's FP8 quantization_config included.
YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "original_max_position_embeddings": 4096}
V3_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "type": "yarn"},
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
V2_LITE_CONFIG = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707, "type": "yarn"},
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "preset,config", [("deepseek-v3", V3_CONFIG), ("deepseek-v2-lite", V2_LITE_CONFIG)]
)
def test_the_published_configs_read_as_their_presets(preset, config):
    shape = ModelShape.from_config(ModelConfig.from_dict(config), preset)
    assert shape.same_shape(PRESETS[preset])
    assert shape.is_mla and not shape.shared_expert_gated


@pytest.mark.parametrize(
    "shape,total,active",
    [(V3, 671e9, 37e9), (V2_LITE, 15.7e9, 2.4e9), (V2, 236e9, 21e9)],
    ids=["v3", "v2-lite", "v2"],
)
def test_parameter_counts_match_the_published_totals_and_actives(shape, total, active):
    # Matmul weights (norms, ~1 M, aside): the 61 (V3) decoder layers, the embedding and the LM
    # head. V3's published 671 B leaves out its 14 B multi-token prediction module, as we do.
    assert shape.num_params == pytest.approx(total, rel=2e-3)
    # DeepSeek counts a token's activated parameters without the embedding table (a lookup) but
    # with the LM head: V3 36.6 B ("37 B"), V2-Lite 2.45 B ("2.4 B"), V2 20.9 B ("21 B"). The
    # published figures have two digits; V2-Lite's is 2.1% under the count.
    activated = shape.active_layers_params + shape.embedding_params
    assert activated == pytest.approx(active, rel=0.025)
    assert shape.flops_per_token == 2 * shape.active_layers_params


def test_a_token_caches_one_latent_a_layer_shared_by_every_head():
    assert V3.kv_bytes_per_token("bfloat16") == 61 * (512 + 64) * 2
    assert V2_LITE.kv_bytes_per_token("bfloat16") == 27 * 576 * 2
    assert V3.kv_bytes_per_token("float32") == 61 * 576 * 4
    # A GQA model of 8 KV heads of 128 caches 2 x 8 x 128 numbers a layer: Llama-3.1-405B
    # (126 layers) 7.3 times V3's latent a token, Llama-3-70B (80 layers) 4.7 times.
    assert LLAMA_405B.kv_bytes_per_token("bfloat16") == 126 * 2 * 8 * 128 * 2
    ratio = LLAMA_405B.kv_bytes_per_token("bfloat16") / V3.kv_bytes_per_token("bfloat16")
    assert ratio == pytest.approx(7.34, abs=0.01)
    assert LLAMA_70B.kv_bytes_per_token("bfloat16") / V3.kv_bytes_per_token(
        "bfloat16"
    ) == pytest.approx(4.66, abs=0.01)
    # The pool's layout: one plane, one head of kv_lora_rank + qk_rope_head_dim.
    layout = V3.kv_layout(16, "bfloat16")
    assert layout == KVLayout(61, 16, 1, 576, "bfloat16", planes=1)
    assert layout.bytes_per_block == V3.kv_bytes_per_block(16, "bfloat16")
    cfg = ModelConfig.from_dict(V3_CONFIG)
    assert layout == KVLayout.for_model(cfg, 16, "bfloat16")  # the engine's own
    gqa = LLAMA_70B.kv_layout(16, "bfloat16")
    assert (gqa.planes, gqa.num_kv_heads, gqa.head_dim) == (2, 8, 128)
    assert gqa.bytes_per_block == LLAMA_70B.kv_bytes_per_block(16, "bfloat16")


def test_attention_pairs_cost_the_absorbed_forms_flops():
    # Per head and (query, key) pair: scores over the latent and k_pe (2 x 576), values over
    # c_kv (2 x 512), against a GQA model's 2 x 128 + 2 x 128.
    assert V3.flops_per_attention_pair == 61 * 128 * (2 * 576 + 2 * 512)
    assert V2_LITE.flops_per_attention_pair == 27 * 16 * (2 * 576 + 2 * 512)
    assert LLAMA_70B.flops_per_attention_pair == 80 * 64 * (2 * 128 + 2 * 128)


# --- FLOPs against torch's count ----------------------------------------------------------------


def tiny_deepseek(q_lora_rank: int) -> ModelShape:
    """Two layers: one dense, one of 4 routed experts (2 a token) and 2 shared ones."""
    config = {
        **V2_LITE_CONFIG,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "q_lora_rank": q_lora_rank or None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "vocab_size": 100,
        "max_position_embeddings": 256,
    }
    return ModelShape.from_config(ModelConfig.from_dict(config), f"tiny-q{q_lora_rank}")


def absorbed_forward(s: ModelShape, contexts: list[int], new: list[int]) -> None:
    """DeepSeek's forward in the absorbed form over sequences of `contexts[i]` cached tokens
    taking `new[i]` tokens each, causal, sampling each sequence's last position. Weights are
    random: only the operations count."""
    g = torch.Generator().manual_seed(0)
    h, heads, nope, rope = s.hidden_size, s.num_heads, s.qk_nope_head_dim, s.head_dim
    lora, v_dim = s.kv_lora_rank, s.v_head_dim

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    def mlp(x: torch.Tensor, width: int) -> torch.Tensor:
        gate, up, down = w(width, h), w(width, h), w(h, width)
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    tokens = sum(new)
    x = w(tokens, h)
    for layer in range(s.num_layers):
        if s.q_lora_rank:
            q = norm(x @ w(s.q_lora_rank, h).T) @ w(heads * (nope + rope), s.q_lora_rank).T
        else:
            q = x @ w(heads * (nope + rope), h).T
        q_nope, q_pe = q.view(tokens, heads, nope + rope).split([nope, rope], dim=-1)
        c_kv, k_pe = (x @ w(lora + rope, h).T).split([lora, rope], dim=-1)
        w_uk, w_uv = w(heads, nope, lora), w(heads, v_dim, lora)  # kv_b_proj's two halves
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, L + R]
        new_latent = torch.cat([norm(c_kv), k_pe], dim=-1)  # what the cache stores
        out_lat = torch.empty(tokens, heads, lora)
        start = 0
        for context, n in zip(contexts, new):
            latent = torch.cat([w(context, lora + rope), new_latent[start : start + n]])
            for i in range(n):  # each query over its own causal prefix
                keys = latent[: context + i + 1]
                probs = torch.softmax(query[start + i] @ keys.T, dim=-1)  # [H, keys]
                out_lat[start + i] = probs @ keys[:, :lora]
            start += n
        out = torch.einsum("thl,hvl->thv", out_lat, w_uv).reshape(tokens, heads * v_dim)
        x = x + out @ w(h, heads * v_dim).T
        if layer < s.num_layers - s.num_sparse_layers:
            x = x + mlp(x, s.intermediate_size)
            continue
        scores = torch.softmax(x @ w(s.num_experts, h).T, dim=-1)  # the router
        chosen = scores.topk(s.experts_per_token, dim=-1).indices
        routed = torch.stack(  # each token through its k experts (weights random: any k)
            [
                sum(mlp(x[t : t + 1], s.moe_intermediate_size)[0] for _ in chosen[t])
                for t in range(tokens)
            ]
        )
        x = x + routed + mlp(x, s.shared_expert_intermediate_size)
    last = torch.tensor([sum(new[: i + 1]) - 1 for i in range(len(new))])
    _ = x[last] @ w(s.vocab_size, h).T  # the LM head, for the sampled rows


@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize(
    "contexts,new",
    [([7, 0, 19], [1, 1, 1]), ([0, 9], [6, 4])],
    ids=["decode", "prefill"],
)
def test_an_mla_models_flops_are_those_torch_counts_in_the_absorbed_form(
    q_lora_rank, contexts, new
):
    s = tiny_deepseek(q_lora_rank)
    assert s.num_sparse_layers == 1 and s.shared_expert_intermediate_size == 32
    shape = sum(
        (StepShape.prefill(1, n, c) for c, n in zip(contexts[1:], new[1:])),
        StepShape.prefill(1, new[0], contexts[0]),
    )
    expected = (
        s.flops_per_token * shape.num_tokens
        + s.flops_per_attention_pair * shape.num_pairs
        + s.flops_per_logits_row * shape.num_rows
    )
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        absorbed_forward(s, contexts, new)
    assert counter.get_total_flops() == expected
    # The roofline's compute of the step is those FLOPs over the rate (1 FLOP/s here), the
    # weights and the latent read at a bandwidth too large to matter.
    step = roofline_step(s, "float32", 1e-12, 1e12, 0.0, 0.0)
    assert step.time(shape) == pytest.approx(expected, rel=1e-9)


# --- tensor parallelism -------------------------------------------------------------------------


def test_a_tensor_parallel_group_holds_the_latent_whole_on_every_gpu():
    a, h100 = Assumptions(), DEVICES["h100"]
    mla = roofline_profile(V2_LITE, "h100")
    gqa = roofline_profile(LLAMA_70B, "h100")
    assert mla.tp_sizes == [1, 2, 4, 8] and gqa.tp_sizes == [4, 8]
    kv = V2_LITE.kv_bytes_per_token("bfloat16")
    for g in (1, 2, 4, 8):
        p = mla.at_tp(g)
        assert V2_LITE.kv_replicas(g) == g
        # Each GPU reads the whole latent of every context token: at G GPUs' bandwidth, G
        # copies, the time of one copy at one GPU's.
        assert p.step.per_context_s == pytest.approx(kv / (h100.gbps * 1e9 * 0.75))
        # The pool: G GPUs' memory less the weights (and the G - 1 extra copies of
        # kv_a_proj_with_mqa and the router) holds each block G times.
        extra = 27 * (g - 1) * 2048 * 576 + 26 * (g - 1) * 2048 * 64
        assert V2_LITE.replicated_params(g) == extra
        pool = g * (80 * 0.9 - 4) * 1e9 - (V2_LITE.num_params + extra) * 2
        assert p.kv_blocks == int(pool // (g * V2_LITE.kv_bytes_per_block(16, "bfloat16")))
        # One copy of the latent leaves a group at one GPU's rate: each GPU sends its own copy.
        assert p.transfer.bytes_per_s == a.transfer_gbps * 1e9
    # Eight GPUs hold 1.75 times one GPU's latents (the weights' share freed), not 8 or more.
    assert mla.at_tp(8).kv_blocks / mla.kv_blocks == pytest.approx(1.75, abs=0.01)
    # GQA with a KV head a GPU splits the KV: TP 8 reads half TP 4's a GPU, and holds more.
    four, eight = gqa.at_tp(4), gqa.at_tp(8)
    assert eight.step.per_context_s == pytest.approx(four.step.per_context_s / 2)
    assert eight.kv_blocks > 2 * four.kv_blocks
    assert LLAMA_70B.kv_replicas(8) == 1 and LLAMA_70B.replicated_params(8) == 0


def test_ranks_that_share_a_gqa_kv_head_each_hold_a_copy():
    qwen = PRESETS["qwen3-30b-a3b"]  # 4 KV heads
    assert [qwen.kv_replicas(g) for g in (1, 2, 4, 8)] == [1, 1, 1, 2]
    p = roofline_profile(qwen, "h100").at_tp(8)
    kv = qwen.kv_bytes_per_token("bfloat16")
    assert p.step.per_context_s == pytest.approx(2 * kv / (8 * 3350e9 * 0.75))
    assert p.transfer.bytes_per_s == 4 * 50e9


def test_the_decode_step_reads_weights_touched_experts_and_each_latent_once():
    p = roofline_profile(V2_LITE, "h100", tp_sizes=[1])
    s = p.step
    byte_s = 1 / (3350e9 * 0.75)
    assert s.weights_s == pytest.approx(V2_LITE.step_weight_bytes("bfloat16") * byte_s)
    assert s.expert_weights_s == pytest.approx(V2_LITE.expert_weight_bytes("bfloat16") * byte_s)
    decode = StepShape.decode(32, 4000)
    memory = (
        s.weights_s
        + s.expert_weights_s * (1 - (1 - 6 / 64) ** 32)
        + 32 * 4001 * 27 * 576 * DTYPE_BYTES["bfloat16"] * byte_s
    )
    assert s.time(decode) == pytest.approx(s.base_s + 32 * s.per_seq_s + memory)


def test_the_simulator_builds_a_one_plane_latent_pool_and_moves_latents():
    p = roofline_profile(V2_LITE, "h100", tp_sizes=[1])
    sim = Simulation(Deployment(1, 1), p)
    layouts = {node.engine.layout for node in sim.nodes.values()}
    assert layouts == {KVLayout(27, 16, 1, 576, "bfloat16", planes=1)}
    assert sim.kv.bytes_per_block == 16 * 27 * 576 * 2
    (outcome,) = sim.run([SimRequest(0.0, 100, 4)]).outcomes
    assert outcome.success and outcome.output_len == 4


def test_deepseek_v3_in_bf16_fits_no_node_of_eight_h100s_or_h200s():
    # 1.34 TB of weights against 8 x 80 GB or 8 x 141 GB: no room for KV on any node size.
    v3_bf16 = dataclasses.replace(V3, fp8_block=None)
    assert v3_bf16.weight_bytes("bfloat16") == v3_bf16.num_params * 2
    assert v3_bf16.weight_bytes("bfloat16") / 1e12 == pytest.approx(1.342, abs=0.001)
    for device in ("h100", "h200"):
        with pytest.raises(ValueError, match="GB of bfloat16 weights.*no room for KV on 8 x"):
            roofline_profile(v3_bf16, device)


def test_deepseek_v3_in_fp8_is_a_byte_a_weight_and_a_float32_scale_a_block():
    # The projections' 668.0 B weights at a byte each; the embedding, the LM head, the 58
    # routers and kv_b_proj (dequantized at load) in bfloat16. Scales: 128x128 blocks of each
    # matrix, ragged ones whole. Per layer q_a 12 x 56, q_b 192 x 12, kv_a 5 x 56 (576 rows),
    # o 56 x 128; the 3 dense MLPs' 3 x 144 x 56; each expert and shared expert 3 x 16 x 56.
    embedding, routers, kv_b = 129280 * 7168, 58 * 256 * 7168, 61 * 128 * 256 * 512
    fp8_weights = V3.num_params - 2 * embedding - routers - kv_b
    assert fp8_weights / 1e9 == pytest.approx(668.05, abs=0.01)
    attention_blocks = 12 * 56 + 192 * 12 + 5 * 56 + 56 * 128
    blocks = 61 * attention_blocks + 3 * 3 * 144 * 56 + 58 * 257 * 3 * 16 * 56
    held = fp8_weights + 4 * blocks + 2 * (2 * embedding + routers + kv_b)
    assert V3.weight_bytes("bfloat16") == held
    assert V3.weight_bytes("bfloat16") / 1e9 == pytest.approx(674.2, abs=0.1)  # 0.16 GB of scales
    experts = 58 * 256 * (3 * 2048 * 7168 + 4 * 3 * 16 * 56)
    assert V3.expert_weight_bytes("bfloat16") == experts
    assert V3.step_weight_bytes("bfloat16") == held - experts - 2 * embedding


@pytest.mark.parametrize("name", [n for n, shape in PRESETS.items() if shape.fp8_block is None])
def test_float_weights_are_sized_as_before(name):
    shape = PRESETS[name]
    assert shape.weight_bytes("bfloat16") == shape.num_params * 2
    for gpus in (1, 2, 8):
        assert shape.replicated_bytes(gpus, "bfloat16") == shape.replicated_params(gpus) * 2


def test_deepseek_v3_in_fp8_fits_a_node_of_eight_h200s_not_eight_h100s():
    profile = roofline_profile(V3, "h200")
    assert profile.tp_sizes == [8]  # 1, 2 and 4 GPUs leave no room for KV
    assert profile.devices_per_node == 8
    assert profile.kv_blocks > 30000  # over 480,000 tokens of latent KV
    with pytest.raises(ValueError, match=r"674 GB of fp8 \(blocks of 128x128\) and bfloat16"):
        roofline_profile(V3, "h100")
