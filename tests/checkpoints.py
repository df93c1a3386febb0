"""Tiny Hugging Face checkpoints built with `transformers` (random weights, fixed seed), carrying
the pdserve-tiny tokenizer, for parity tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pdserve.engine.embedded.tiny import ensure_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

FAMILIES: dict[str, dict] = {
    # GQA 4:1, untied embeddings, Llama-3 rope scaling.
    "llama": dict(
        model_type="llama",
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # qkv bias, tied embeddings.
    "qwen2": dict(
        model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
    ),
    # q/k norm, explicit head_dim unequal to hidden / heads.
    "qwen3": dict(
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # Mistral: Llama's layers under its own name; no sliding window.
    "mistral": dict(
        model_type="mistral",
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    # Shaped for block-scaled FP8 (tests/test_quant_fp8.py): in blocks of 16, hidden_size 72
    # ends in a ragged block while every tensor-parallel share (of 2) is whole blocks.
    "llama_fp8": dict(
        model_type="llama",
        hidden_size=72,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=False,
    ),
    # In blocks of 32, intermediate_size 88 ends in a ragged block: gate and up fuse unaligned.
    "qwen3_fp8": dict(
        model_type="qwen3",
        hidden_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=88,
        tie_word_embeddings=False,
    ),
    # Mixtures of experts (4 experts, top-2): every token's two experts, renormalised.
    "mixtral": dict(
        model_type="mixtral",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    # A shared expert with its sigmoid gate, qkv bias, the top-2 weights not renormalised.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    # q/k norm, renormalised top-2, and a dense layer between two sparse ones (mlp_only_layers).
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    # DeepSeek-V2-Lite's shape: multi-head latent attention without q_lora_rank, YaRN with
    # mscale unequal to mscale_all_dim (cos/sin and the softmax scale both change), a dense first
    # layer, softmax routing limited to 2 of 4 expert groups, two shared experts, scaled weights.
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=3,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        tie_word_embeddings=False,
    ),
    # DeepSeek-V3's shape: q through q_lora_rank, sigmoid scores with a correction bias (set
    # random, see build_checkpoint), groups ranked by their two best, renormalised and scaled.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=3,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        tie_word_embeddings=False,
    ),
    # Windowed attention from transformers' own layer_types: Qwen2 with use_sliding_window from
    # layer 1 on (one full layer, two windowed ones: three KV groups), and Mistral's window on
    # every layer (one windowed group).
    "qwen2_sliding": dict(
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=12,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
    "mistral_sliding": dict(
        model_type="mistral",
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=12,
        tie_word_embeddings=False,
    ),
    # gpt-oss: attention sinks, sliding (window 8) and full layers alternating, head_dim apart
    # from hidden / heads, YaRN whose ramp and attention factor change the rotary table, 4
    # experts top-2 with a clamped SwiGLU whose alpha and limit are not gpt-oss's own (the limit
    # low enough to clamp often); biases and sinks set random (see build_checkpoint).
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_hidden_layers=4,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
        swiglu_alpha=1.3,
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
        },
        tie_word_embeddings=False,
    ),
    # gpt-oss with experts MXFP4 can hold (test_quant_mxfp4): hidden and expert widths in whole
    # blocks of 32; the experts' 96 columns split in two are 1.5 blocks a rank.
    "gpt_oss_mxfp4": dict(
        model_type="gpt_oss",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=96,
        swiglu_alpha=1.3,
        swiglu_limit=1.0,
        tie_word_embeddings=False,
    ),
    # Gemma 3: 7 layers of 5 sliding to 1 full (seven KV groups), a window of 8, distinct local
    # and global rope bases (the global layers' scaled), query_pre_attn_scalar apart from head_dim,
    # head_dim apart from hidden / heads, a hidden size whose square root (the embedding's scale)
    # is not a round number, a cap on the logits, tied embeddings.
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=7,
        sliding_window=8,
        query_pre_attn_scalar=20,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        final_logit_softcapping=5.0,
        tie_word_embeddings=True,
    ),
    # The same text model inside Gemma3ForConditionalGeneration (a tiny SigLIP vision tower).
    "gemma3": dict(
        model_type="gemma3",
        text_config="gemma3_text",
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        initializer_range=0.2,
    ),
}
# Llama 4's text model: 3 chunked rotary layers (chunks of 8) and a NoPE full-attention one
# (no_rope_layer_interval 4), the QK L2 norm, a temperature that changes every 4 positions
# (floor_scale 4; attn_scale 0.5, enough to change tokens), dense layers (intermediate_size_mlp)
# between sparse ones (4 experts top-1 and a shared expert, intermediate_size wide), head_dim
# apart from hidden / heads.
LLAMA4_TEXT = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    num_hidden_layers=4,
    no_rope_layer_interval=4,
    attention_chunk_size=8,
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.5,
    interleave_moe_layer_step=2,
    num_local_experts=4,
    num_experts_per_tok=1,
    intermediate_size=48,
    intermediate_size_mlp=96,
    tie_word_embeddings=False,
)
FAMILIES["llama4_text"] = dict(model_type="llama4_text", **LLAMA4_TEXT)
# Llama4ForConditionalGeneration: that text model beside a tiny vision tower and projector.
FAMILIES["llama4"] = dict(
    model_type="llama4",
    text_config=LLAMA4_TEXT,
    vision_config=dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vision_output_dim=32,
        image_size=28,
        patch_size=14,
        projector_input_dim=32,
        projector_output_dim=32,
    ),
)
# Gemma 4, shaped as its E releases: full layers' heads twice as wide as the sliding ones' (two
# sliding pages to a slot of the pool), the last 3 of 7 layers reading earlier layers' KV (a
# sliding one and two full ones, with a double-wide MLP), per-layer embeddings from a table of
# more rows than the vocabulary, proportional rope on the full layers turning half of each head,
# bases apart, a window of 8, a cap on the logits.
GEMMA4_TEXT = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    layer_types=["sliding_attention"] * 2
    + ["full_attention"]
    + ["sliding_attention"] * 2
    + ["full_attention"] * 2,
    num_kv_shared_layers=3,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=640,
    use_double_wide_mlp=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.5,
            "rope_theta": 5000.0,
        },
    },
    final_logit_softcapping=5.0,
    tie_word_embeddings=True,
)
FAMILIES["gemma4_text"] = dict(model_type="gemma4_text", **GEMMA4_TEXT)
# Gemma 4 shaped as its 31B and 26B-A4B releases: fewer, wider KV heads on the full layers whose
# values are their keys' projection (attention_k_eq_v), their pages half the sliding layers' (two
# full layers to a slot), no per-layer embeddings, experts (4, top-2) beside every MLP.
FAMILIES["gemma4_moe"] = dict(
    model_type="gemma4_text",
    **{
        **GEMMA4_TEXT,
        "num_hidden_layers": 6,
        "layer_types": (["sliding_attention"] * 2 + ["full_attention"]) * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_global_key_value_heads": 2,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 24,
    },
)
# The E-shaped text model inside Gemma4ForConditionalGeneration (a tiny vision tower), its
# image, video and audio placeholder tokens inside the tiny vocabulary.
FAMILIES["gemma4"] = dict(
    model_type="gemma4",
    text_config=GEMMA4_TEXT,
    image_token_id=7,
    video_token_id=8,
    audio_token_id=9,
    vision_config=dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        position_embedding_size=64,
    ),
    audio_config=None,
    initializer_range=0.2,
)
# The Gated DeltaNet hybrids: 2 linear key heads of 16 serving 4 value heads of 16, a
# convolution of 4, gated attention of 4 heads over 2 KV heads of 32 (apart from hidden /
# heads), partial rotary. Qwen3.5: a full layer every 2 (full_attention_interval), half of each
# head turning. Qwen3.5-MoE: 3 linear layers to 1 full (layer_types), 4 experts top-2 and a
# gated shared expert in every layer. Qwen3-Next: its fused projections, a quarter of each head
# turning, a dense layer among sparse ones (mlp_only_layers), the top 2 not renormalised.
HYBRID = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_num_value_heads=4,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
HYBRID_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
FAMILIES["qwen3_5_text"] = dict(
    model_type="qwen3_5_text",
    **HYBRID,
    full_attention_interval=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
FAMILIES["qwen3_5_moe_text"] = dict(
    model_type="qwen3_5_moe_text",
    **HYBRID,
    **HYBRID_MOE,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
FAMILIES["qwen3_next"] = dict(
    model_type="qwen3_next",
    **HYBRID,
    **HYBRID_MOE,
    mlp_only_layers=[1],
    norm_topk_prob=False,
)
# That Qwen3.5 text model inside Qwen3_5ForConditionalGeneration (a tiny vision tower).
FAMILIES["qwen3_5"] = dict(
    model_type="qwen3_5",
    text_config="qwen3_5_text",
    vision_config=dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
    ),
    initializer_range=0.2,
)
# Gemma's and the hybrids' norms scale by 1 + weight: their weights lie around zero.
ZERO_CENTRED = (-0.5, 0.5)
NORM_WEIGHTS = {
    family: ZERO_CENTRED
    for family in (
        "gemma3_text",
        "gemma3",
        "qwen3_5_text",
        "qwen3_5",
        "qwen3_5_moe_text",
        "qwen3_next",
    )
}
# Families whose biases and attention sinks are set random: transformers starts them at zero
# (the sinks near it), which would test nothing.
RANDOM_BIASES = ("gpt_oss", "gpt_oss_mxfp4")
# Scales transformers starts at one (Gemma 4's layer scalar and router scales): set random.
RANDOM_SCALES = ("layer_scalar", "router.scale", "per_expert_scale")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


def build_checkpoint(
    family: str, out_dir: Path, seed: int = 0, max_shard_size: str | None = None
) -> Path:
    """Writes a tiny `family` checkpoint (float32 safetensors) with the pdserve-tiny tokenizer."""
    import transformers

    tiny = ensure_tiny_model()
    opts = dict(FAMILIES[family])
    model_type = opts.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    vocab = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny / "tokenizer.json"))
    sizes = dict(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.2,
    )
    text = opts.pop("text_config", None)
    auto_class = transformers.AutoModelForCausalLM
    if text is None:
        config = config_cls(**{**sizes, **opts})
    else:  # a multimodal wrapper: the sizes are its text model's
        if isinstance(text, str):  # another family's config
            text_opts = dict(FAMILIES[text])
            text_type = text_opts.pop("model_type")
            text = transformers.AutoConfig.for_model(text_type, **{**sizes, **text_opts})
        else:
            text = {**sizes, **text}
        config = config_cls(text_config=text, **opts)
        auto_class = transformers.AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = auto_class.from_config(config, torch_dtype=torch.float32)
    # Norm weights away from one so their use is tested too.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(*NORM_WEIGHTS.get(family, (0.5, 1.5)))
            if family in RANDOM_BIASES and name.endswith(("bias", "sinks")):
                param.uniform_(-1.0, 1.0)
            if name.endswith(RANDOM_SCALES):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros would test nothing
                buffer.uniform_(-0.2, 0.2)
            if name.endswith(RANDOM_SCALES):
                buffer.uniform_(0.5, 1.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, out_dir / name)
    return out_dir


def dequantize_checkpoint_fp8(src: Path, out_dir: Path) -> Path:
    """The float32 checkpoint whose weights are exactly an FP8 checkpoint's, dequantized by the
    reference: what the FP8 checkpoint's tokens must equal."""
    import json

    from safetensors.torch import load_file, save_file

    from pdserve.engine.quant.fp8_reference import dequantize

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = load_file(str(src / "model.safetensors"))
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "weight_scale_inv")
        plain[name] = tensor if scale is None else dequantize(tensor, scale, block)
    save_file(plain, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out_dir / path.name)
    return out_dir


def dequantize_checkpoint_compressed_tensors(src: Path, out_dir: Path) -> Path:
    """The float32 checkpoint whose weights are exactly a compressed-tensors checkpoint's,
    dequantized by the reference: what its tokens must equal."""
    import json

    from safetensors.torch import load_file, save_file

    from pdserve.engine.quant.compressed_tensors_reference import dequantize, unpack_int4

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    tensors = load_file(str(src / "model.safetensors"))
    plain = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        scale = tensors.get(f"{module}.weight_scale")
        if scale is None:
            plain[name] = tensor
        elif kind == "weight_packed":
            out, cols = tensors[f"{module}.weight_shape"].tolist()
            zero = tensors.get(f"{module}.weight_zero_point")
            zero = None if zero is None else unpack_int4(zero, out, dim=0)
            plain[f"{module}.weight"] = dequantize(unpack_int4(tensor, cols), scale, zero)
        elif kind == "weight":
            plain[name] = dequantize(tensor, scale)
    save_file(plain, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out_dir / path.name)
    return out_dir


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    model_class: str = "AutoModelForCausalLM",
) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time (no padding), float32, by the
    model loaded as `model_class`."""
    import transformers

    model_cls = getattr(transformers, model_class)
    model = model_cls.from_pretrained(model_dir, torch_dtype=torch.float32)
    return hf_model_greedy(model, prompts, max_new_tokens)


def hf_model_greedy(
    model,  # noqa: ANN001 (a transformers model)
    prompts: list[list[int]],
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy generation by a loaded transformers model, one prompt at a time (no padding)."""
    model.eval()
    # No end-of-sequence token: the engine's side ignores EOS, so the EOS token may be the
    # greedy choice here too (min_new_tokens would forbid it instead).
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def build_draft_checkpoint(model_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """A draft for a checkpoint: its first num_layers layers, the rest of it as it is (the same
    tokenizer and vocabulary), so it agrees with the full model often but not always."""
    from pdserve.bench.speculative import first_layers_checkpoint

    return first_layers_checkpoint(model_dir, out_dir, num_layers)


def dequantize_checkpoint_packed(src: Path, out_dir: Path) -> Path:
    """The float32 checkpoint whose weights are exactly an AWQ or GPTQ checkpoint's, dequantized
    by the format's reference: what the packed checkpoint's tokens must equal."""
    import json

    from safetensors.torch import load_file, save_file

    from pdserve.engine.quant import awq_reference, gptq_reference

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    qcfg = config.pop("quantization_config")
    tensors = load_file(str(src / "model.safetensors"))
    plain = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        if kind in ("qzeros", "scales", "g_idx"):
            continue
        if kind != "qweight":
            plain[name] = tensor
            continue
        zeros, scales = tensors[module + ".qzeros"], tensors[module + ".scales"]
        if qcfg["quant_method"] == "awq":
            weight = awq_reference.dequantize(tensor, zeros, scales, qcfg["group_size"])
        else:
            v1 = qcfg.get("checkpoint_format", "gptq") == "gptq"
            g_idx = tensors[module + ".g_idx"]
            weight = gptq_reference.dequantize(tensor, zeros, scales, g_idx, qcfg["bits"], v1)
        plain[module + ".weight"] = weight
    save_file(plain, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out_dir / path.name)
    return out_dir


def dequantize_checkpoint_mxfp4(src: Path, out_dir: Path) -> Path:
    """The float32 gpt-oss checkpoint whose experts are exactly an MXFP4 checkpoint's,
    dequantized by the reference into transformers' float layout ([experts, in, out])."""
    import json

    from safetensors.torch import load_file, save_file

    from pdserve.engine.quant.mxfp4_reference import dequantize

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    tensors = load_file(str(src / "model.safetensors"))
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            weight = name.removesuffix("_blocks")
            scales = tensors[weight + "_scales"]
            plain[weight] = dequantize(tensor, scales).transpose(1, 2).contiguous()
        else:
            plain[name] = tensor
    save_file(plain, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out_dir / path.name)
    return out_dir
