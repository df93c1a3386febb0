"""Tiny Hugging Face checkpoints built with `transformers` (random weights, fixed seed), carrying
the pdserve-tiny tokenizer, for parity tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pdserve.engine.tiny_model import ensure_tiny_model

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
}


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
    config = config_cls(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.2,
        **opts,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Norm weights away from one so their use is tested too.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, out_dir / name)
    return out_dir


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time (no padding), float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs
