"""Trains `pdserve-stories` from nothing, on the CPU, with plain torch: a byte-level BPE tokenizer
and a small Llama-architecture model on the story grammar's corpus, saved as a Hugging Face-format
checkpoint (bfloat16 safetensors, tokenizer, chat template) that pdserve and `transformers` load.

    # the committed checkpoint, in two runs (docs/models.md): stories and chat turns from scratch,
    # then on from there with the tool conversations
    python -m pdserve.bench.stories.train --out /tmp/stories-base --plot docs/stories_training.png
    python -m pdserve.bench.stories.train --init-from /tmp/stories-base --corpus stories+tools \
        --windows documents --steps 800 --lr 2e-3 --warmup-steps 30 \
        --out engine/embedded/pdserve-stories --plot docs/stories_tools_training.png
    python -m pdserve.bench.stories.train --out /tmp/stories --steps 50 --hidden-size 64   # a quick look

Same seed, same corpus, same tokenizer, same batches: the loss curve repeats within the noise of
floating-point summation order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.bench.stories.corpus import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    corpus,
    render,
)
from pdserve.bench.stories.grammar import TOOLS
from pdserve.bench.stories.recognizer import accepts_call, read, tool_calls


@dataclass(slots=True)
class Shape:
    """The model's architecture (Llama: RMSNorm, rotary, grouped-query attention, SwiGLU)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        d = s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * d, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.num_heads * d, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s, d = self.s, self.s.head_dim
        q = self.q_proj(x).view(b, t, s.num_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.num_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.num_kv_heads, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class StoryModel(nn.Module):
    """Llama for training, its parameters named as in Hugging Face checkpoints; the LM head is
    the embedding (tied)."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.model.layers = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.model.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        angles = torch.outer(torch.arange(s.max_position_embeddings).float(), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new: int, stop: set[int]) -> list[int]:
        """Greedy continuation (no cache: for a quick look at the end of training)."""
        out = list(ids)
        for _ in range(max_new):
            window = out[-self.s.max_position_embeddings :]
            token = int(self(torch.tensor([window]))[0, -1].argmax())
            out.append(token)
            if token in stop:
                break
        return out[len(ids) :]


# --- data ----------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int):  # noqa: ANN201
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
    tok.train_from_iterator(docs, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def token_stream(tok, docs: list[str]) -> torch.Tensor:  # noqa: ANN001
    """Every document as <s> ... </s>, one after the other."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# --- training ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Recipe:
    seed: int = 0
    corpus_megabytes: float = 8.0
    steps: int = 800
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 0  # 0: every core this process may use
    corpus: str = "stories"  # or "stories+tools" (corpus.CORPORA)
    # Where a training window starts: "anywhere" in the token stream, or at a document's start
    # ("documents"), so that a conversation's offered tools are never cut off from its call.
    windows: str = "anywhere"
    # A checkpoint to go on training (its tokenizer, shape and weights) instead of starting anew.
    init_from: str = ""


def learning_rate(r: Recipe, step: int) -> float:
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    progress = (step - r.warmup_steps) / max(1, r.steps - r.warmup_steps)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(shape: Shape, recipe: Recipe, out_dir: Path, plot: Path | None, progress: bool) -> dict:
    if recipe.windows not in ("anywhere", "documents"):
        raise ValueError(f"windows must be anywhere or documents, got {recipe.windows!r}")
    torch.set_num_threads(recipe.threads or len(os.sched_getaffinity(0)))
    torch.manual_seed(recipe.seed)
    started = time.monotonic()
    docs = corpus(recipe.seed, int(recipe.corpus_megabytes * 1e6), recipe.corpus)
    if recipe.init_from:
        tok, shape, model = load_checkpoint(Path(recipe.init_from))
    else:
        tok = train_tokenizer(docs, shape.vocab_size)
        shape.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        model = StoryModel(shape)
    data = token_stream(tok, docs)
    if recipe.windows == "documents":
        bos = tok.token_to_id(BOS)
        starts = (data == bos).nonzero().flatten().tolist()
        doc_starts = [i for i in starts if i + recipe.seq_len + 1 <= len(data)]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": rest, "weight_decay": 0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    batches = random.Random(recipe.seed + 1)
    losses: list[float] = []
    steps = range(recipe.steps)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="training pdserve-stories", unit="step")
    for step in steps:
        if recipe.windows == "documents":  # each window opens a document, its first turn seen
            starts = [
                doc_starts[batches.randrange(len(doc_starts))] for _ in range(recipe.batch_size)
            ]
        else:
            starts = [
                batches.randrange(len(data) - recipe.seq_len - 1) for _ in range(recipe.batch_size)
            ]
        window = torch.stack([data[s : s + recipe.seq_len + 1] for s in starts])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if progress:
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.monotonic() - started
    final = sum(losses[-50:]) / len(losses[-50:])
    record = {
        "shape": asdict(shape),
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_documents": len(docs),
        "corpus_tokens": len(data),
        "seconds": round(seconds, 1),
        "final_loss": round(final, 4),  # mean of the last 50 steps
        "losses": [round(x, 4) for x in losses],
        "samples": samples(model, tok),
    }
    if recipe.init_from:  # the record of the run it went on from, so the chain stays readable
        start = Path(recipe.init_from) / "training.json"
        record["init"] = json.loads(start.read_text()) if start.is_file() else None
    save(model, tok, out_dir, record)
    if plot is not None:
        plot_losses(losses, plot, record)
    return record


def load_checkpoint(path: Path) -> tuple[object, Shape, StoryModel]:
    """A checkpoint this script saved: its tokenizer, its shape and its weights (in float32)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    config = json.loads((path / "config.json").read_text())
    shape = Shape(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_theta=config["rope_theta"],
        rms_norm_eps=config["rms_norm_eps"],
    )
    model = StoryModel(shape)
    weights = load_file(str(path / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return Tokenizer.from_file(str(path / "tokenizer.json")), shape, model


def samples(model: StoryModel, tok) -> dict:  # noqa: ANN001
    """Greedy continuations of a few openings, and how many of their sentences the grammar takes."""
    stop = {tok.token_to_id(EOS), tok.token_to_id(IM_END)}
    openings = ["Once upon a time", "One day, Tom", "There was once a little", "Lily liked to"]
    out = {}
    model.eval()
    for opening in openings:
        ids = model.greedy(tok.encode(opening).ids, 120, stop)
        text = opening + tok.decode(ids, skip_special_tokens=True)
        out[opening] = {"text": text, "grammatical": read(text).share}
    # Questions with the tool offered: a where-question should call it, another should not.
    for question in ("Where is the cat?", "Where is Tom?", "What does Mia like to do?"):
        prompt = render([{"role": "user", "content": question}], TOOLS) + IM_START + "assistant\n"
        ids = model.greedy(tok.encode(prompt).ids, 60, stop)
        text = tok.decode(ids, skip_special_tokens=True)
        calls = tool_calls(text)
        out[f"tools: {question}"] = {
            "text": text,
            "calls": len(calls),
            "calls_accepted": sum(map(accepts_call, calls)),
        }
    model.train()
    return out


def save(model: StoryModel, tok, out_dir: Path, record: dict) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    s = model.s
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = [tok.token_to_id(EOS), tok.token_to_id(IM_END)]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": eos,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": s.max_position_embeddings,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")


def plot_losses(losses: list[float], path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per token)")
    ax.set_title(
        f"pdserve-stories: {record['parameters'] / 1e6:.1f}M parameters, "
        f"final loss {record['final_loss']:.3f}, {record['seconds'] / 60:.0f} min"
    )
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.stories.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory (written over)")
    p.add_argument("--plot", type=Path, default=None, help="loss curve PNG (default: OUT/loss.png)")
    p.add_argument("--no-progress", action="store_true")
    for cls in (Shape, Recipe):
        for name, value in asdict(cls()).items():
            p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = vars(p.parse_args(argv))
    shape = Shape(**{k: args[k] for k in asdict(Shape())})
    recipe = Recipe(**{k: args[k] for k in asdict(Recipe())})
    plot = args["plot"] or args["out"] / "loss.png"
    record = train(shape, recipe, args["out"], plot, not args["no_progress"])
    print(f"{record['parameters'] / 1e6:.2f}M parameters, {record['corpus_tokens']} corpus tokens")
    print(
        f"final loss {record['final_loss']:.4f} after {recipe.steps} steps, {record['seconds']:.0f} s"
    )
    for name, sample in record["samples"].items():
        if "grammatical" in sample:
            print(f"[{sample['grammatical']:.0%} grammatical] {sample['text']}")
        else:
            print(
                f"[{name}: {sample['calls_accepted']}/{sample['calls']} calls accepted] {sample['text']!r}"
            )
    print(f"checkpoint -> {args['out']}, loss curve -> {plot}")


if __name__ == "__main__":
    main()
