"""`pdserve-tiny`: a small random-weight Llama-shaped checkpoint with a byte-level BPE tokenizer,
generated deterministically on first use into a cache folder and then loaded through the same
Hugging Face-format loading code as any checkpoint. Its text is noise; tests use it for speed."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import cache_root

if TYPE_CHECKING:
    import torch

TINY_NAME = "pdserve-tiny"
TINY_VERSION = "1"
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# A little English so the BPE merges are words, not noise.
CORPUS = """
pdserve serves language models with prefill and decode on separate workers. The prefill worker
reads the whole prompt at once and is bound by compute. The decode worker produces one token at a
time for every running sequence and is bound by memory bandwidth. Pages of the key value cache
move from one worker to the other. The coordinator routes each request, admits each sequence into
a decode batch when there is room, and streams the tokens back to the client as they are made.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
The quick brown fox jumps over the lazy dog. Once upon a time there was a small model that
wanted to talk. It said hello to everyone it met, and everyone said hello back. 0123456789
""".strip()


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Trains a byte-level BPE on the embedded corpus; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def random_llama_weights(cfg: dict, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors of a Llama-shaped model, normal(0, std), norms at one."""
    import torch  # here, not at the top: a coordinator resolves the model without torch

    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w = {
        "model.embed_tokens.weight": normal(cfg["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
    }
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = normal(cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(q, h)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, q)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
    return w


def write_checkpoint(out_dir: Path, cfg: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = random_llama_weights(cfg, seed)
    dtype = getattr(torch, cfg.get("torch_dtype", "float32"))
    save_file(
        {k: v.to(dtype).contiguous() for k, v in weights.items()},
        str(out_dir / "model.safetensors"),
    )
    gen_cfg = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))


def ensure_tiny_model() -> Path:
    """The pdserve-tiny directory, generated on first use (safe when processes race to it)."""
    target = cache_root() / f"{TINY_NAME}-v{TINY_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=target.parent))
    try:
        vocab_size = build_tokenizer(tmp)
        write_checkpoint(tmp, {**TINY_CONFIG, "vocab_size": vocab_size}, seed=0)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
