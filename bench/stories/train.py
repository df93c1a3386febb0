"""Trains `pdserve-stories` from nothing, on the CPU: a byte-level BPE tokenizer and a small Llama
on the story grammar's corpus, saved as a Hugging Face-format checkpoint (bfloat16 safetensors,
tokenizer, chat template) that pdserve and `transformers` load. The model is the engine's own
(`pdserve.engine.models.llama`); training adds only a forward over whole sequences at once.

    # the committed checkpoint, in three runs (docs/models.md): stories and chat turns from
    # scratch, then on from there with the tool conversations, then with reasoning (<think>)
    python -m pdserve.bench.stories.train --out /tmp/stories-base --plot docs/stories_training.png
    python -m pdserve.bench.stories.train --init-from /tmp/stories-base --corpus stories+tools \
        --windows documents --steps 800 --lr 2e-3 --warmup-steps 30 \
        --out /tmp/stories-tools --plot docs/stories_tools_training.png
    python -m pdserve.bench.stories.train --init-from /tmp/stories-tools \
        --corpus stories+tools+think --windows documents --steps 400 --lr 2e-3 \
        --warmup-steps 30 --threads 1 \
        --out engine/embedded/pdserve-stories --plot docs/stories_think_training.png
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.bench.stories.corpus import (
    BOS,
    CHAT_TEMPLATE,
    END_THINK,
    EOS,
    IM_END,
    SPECIAL_TOKENS,
    THINK,
    THINKING_TOKENS,
    corpus,
    generation_prompt,
)
from pdserve.bench.stories.grammar import TOOLS
from pdserve.bench.stories.recognizer import (
    accepts_answer,
    accepts_call,
    read,
    read_thinking,
    tool_calls,
)
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.llama import Attention, LlamaForCausalLM
from pdserve.engine.models.loader import build_model, load_model
from pdserve.engine.models.norm import RMSNorm
from pdserve.kernels.ops import REFERENCE


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

    def config(self) -> dict:
        """Its fields of the checkpoint's config.json (`save` adds the tokenizer's ids)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        """The shape of a checkpoint the engine read."""
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
        )


# The torch reference ops: differentiable (the CPU backend's rotary writes through out=, which
# autograd refuses).
OPS = REFERENCE


class StoryModel(nn.Module):
    """The engine's own Llama (`LlamaForCausalLM`: its embedding, decoder layers with fused
    qkv_proj and gate_up_proj, norms, rotary table and tied LM head) with the forward training
    needs: every position of whole sequences at once, attending causally, without a KV pool."""

    def __init__(self, shape: Shape, llama: LlamaForCausalLM | None = None) -> None:
        """Random weights (`init_weights`, from the global generator), or `llama`'s."""
        super().__init__()
        if llama is None:
            llama = build_model(ModelConfig.from_dict(shape.config()), "float32", "cpu")
            init_weights(llama)
        if any(getattr(m, "packed", None) is not None for m in llama.modules()):
            raise ValueError("its linear layers are packed for inference, without gradients")
        self.shape = shape
        self.llama = llama.train()  # the engine's loader hands it over in eval mode

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, tokens, vocab] at every position of `ids` [batch, tokens], each
        position seeing its sequence up to itself."""
        llama = self.llama
        positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0])
        x = llama.embed_tokens(ids)
        for layer in llama.layers:
            x = x + causal_attention(
                layer.self_attn, norm(layer.input_layernorm, x), positions, llama.cos_sin
            )
            x = x + layer.mlp(norm(layer.post_attention_layernorm, x), OPS)
        return llama.compute_logits(norm(llama.norm, x))

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new: int, stop: set[int]) -> list[int]:
        """Greedy continuation (no cache: for a quick look at the end of training)."""
        out = list(ids)
        for _ in range(max_new):
            window = out[-self.shape.max_position_embeddings :]
            token = int(self(torch.tensor([window]))[0, -1].argmax())
            out.append(token)
            if token in stop:
                break
        return out[len(ids) :]


def norm(layer: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return OPS.rms_norm(x, layer.weight, layer.eps)


def causal_attention(
    attn: Attention, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:
    """The engine's attention layer over whole sequences x [batch, tokens, hidden]: its q, k and
    v (`Attention.project`), causal attention over them where the engine reads the paged pool,
    its output projection."""
    batch, length, _ = x.shape
    q, k, v = (
        t.view(batch, length, -1, attn.head_dim).transpose(1, 2)
        for t in attn.project(x, positions, cos_sin, OPS)
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, attn.q_size))


def checkpoint_tensors(llama: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Its weights under Hugging Face's names, as views of its parameters: qkv_proj split into
    q_proj, k_proj and v_proj, gate_up_proj into gate_proj and up_proj; no lm_head (tied)."""
    tensors = {"model.embed_tokens.weight": llama.embed_tokens.weight}
    for i, layer in enumerate(llama.layers):
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{i}."
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        gate, up = mlp.gate_up_proj.weight.split(mlp.intermediate_size)
        named = {
            "input_layernorm": layer.input_layernorm.weight,
            "self_attn.q_proj": q,
            "self_attn.k_proj": k,
            "self_attn.v_proj": v,
            "self_attn.o_proj": attn.o_proj.weight,
            "post_attention_layernorm": layer.post_attention_layernorm.weight,
            "mlp.gate_proj": gate,
            "mlp.up_proj": up,
            "mlp.down_proj": mlp.down_proj.weight,
        }
        tensors |= {f"{prefix}{name}.weight": tensor for name, tensor in named.items()}
    tensors["model.norm.weight"] = llama.norm.weight
    return tensors


@torch.no_grad()
def init_weights(llama: LlamaForCausalLM) -> None:
    """Norms at one, every matrix from N(0, 0.02), drawn from the global generator in Hugging
    Face's order and shapes. It first makes, and overwrites, the draws of nn.Embedding's and
    nn.Linear's default initialisation, as the trainer's earlier model (an nn.Linear a
    projection) did: so a seed still gives the committed checkpoint's first run its start
    (tests/test_stories_model.py repeats its first steps)."""
    tensors = checkpoint_tensors(llama)
    matrices = [t for t in tensors.values() if t.dim() == 2]
    matrices[0].normal_()  # the embedding
    for matrix in matrices[1:]:
        nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
    for matrix in matrices:
        matrix.normal_(std=0.02)
    for vector in (t for t in tensors.values() if t.dim() == 1):
        vector.fill_(1.0)


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


def add_tokens(tok, tokens: list[str]) -> None:  # noqa: ANN001
    """Adds the tokens the tokenizer lacks, each one id, not special (decoding keeps them)."""
    from tokenizers import AddedToken

    missing = [t for t in tokens if tok.token_to_id(t) is None]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in missing])


def token_stream(tok, docs: list[str]) -> torch.Tensor:  # noqa: ANN001
    """Every document as <s> ... </s>, one after the other."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def unlearned_empty_blocks(tok, data: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The token stream as the loss's targets: each token, but for the `\n</think>` that closes
    an empty think block (ignored: -100). The template writes that block (thinking off), the model
    never does; learned, it would teach the model to close the block at once after the `<think>\n`
    that opens its reasoning when thinking is on."""
    labels = data.clone()
    think, end = tok.token_to_id(THINK), tok.token_to_id(END_THINK)
    if think is None or end is None:
        return labels
    newline = tok.encode("\n", add_special_tokens=False).ids
    empty = torch.tensor([think, *newline, *newline, end])
    if len(data) < len(empty):
        return labels
    found = (data.unfold(0, len(empty), 1) == empty).all(dim=1).nonzero().flatten()
    for start in found.tolist():  # the second newline and </think>: what thinking would replace
        labels[start + 1 + len(newline) : start + len(empty)] = -100
    return labels


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
    corpus: str = "stories"  # or "stories+tools", "stories+tools+think" (corpus.CORPORA)
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
    if recipe.corpus.endswith("+think"):
        add_tokens(tok, THINKING_TOKENS)
    if not recipe.init_from:
        shape.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        model = StoryModel(shape)
    elif tok.get_vocab_size(with_added_tokens=True) > shape.vocab_size:
        model = grow_vocab(model, tok.get_vocab_size(with_added_tokens=True))
        shape = model.shape
    data = token_stream(tok, docs)
    labels = unlearned_empty_blocks(tok, data)
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
        targets = torch.stack([labels[s + 1 : s + recipe.seq_len + 1] for s in starts])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
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
    """A checkpoint this script saved: its tokenizer, its shape and its weights (in float32,
    read by the engine's loader)."""
    from tokenizers import Tokenizer

    llama = load_model(path, "float32", "cpu")
    model = StoryModel(Shape.of(llama.config), llama)
    return Tokenizer.from_file(str(path / "tokenizer.json")), model.shape, model


@torch.no_grad()
def grow_vocab(model: StoryModel, vocab_size: int) -> StoryModel:
    """The model with rows for the tokens added to its tokenizer: its weights, and each new row of
    the (tied) embedding the mean of the old ones, so that a new token starts as an average one."""
    shape = replace(model.shape, vocab_size=vocab_size)
    llama = build_model(ModelConfig.from_dict(shape.config()), "float32", "cpu")
    state = model.llama.state_dict()
    old = state["embed_tokens.weight"]
    grown = torch.cat([old, old.mean(0, keepdim=True).expand(vocab_size - len(old), -1)])
    state |= {k: grown for k in ("embed_tokens.weight", "lm_head.weight") if k in state}
    llama.load_state_dict(state)
    return StoryModel(shape, llama)


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
    thinks = tok.token_to_id(THINKING_TOKENS[0]) is not None
    for question in ("Where is the cat?", "Where is Tom?", "What does Mia like to do?"):
        messages = [{"role": "user", "content": question}]
        prompt = generation_prompt(messages, TOOLS)
        if not thinks:  # before the reasoning run, the prompt ended at the turn's header
            prompt = prompt.removesuffix(f"{THINK}\n\n{END_THINK}\n\n")
        ids = model.greedy(tok.encode(prompt).ids, 60, stop)
        text = tok.decode(ids, skip_special_tokens=True)
        calls = tool_calls(text)
        out[f"tools: {question}"] = {
            "text": text,
            "calls": len(calls),
            "calls_accepted": sum(map(accepts_call, calls)),
        }
    if thinks:
        for question in ("Where is the cat?", "Who is Tom?", "Describe Mia in JSON.", "Hello!"):
            for tools in ((), TOOLS):
                messages = [{"role": "user", "content": question}]
                prompt = generation_prompt(messages, tools, thinking=True)
                ids = model.greedy(tok.encode(prompt).ids, 80, stop)
                text = tok.decode(ids, skip_special_tokens=True)
                name = f"thinking{', tools' if tools else ''}: {question}"
                out[name] = {"text": text, "accepted": read_thinking(text).accepted}
                if tools:
                    continue
                prompt = generation_prompt(messages, tools)
                ids = model.greedy(tok.encode(prompt).ids, 80, stop)
                text = tok.decode(ids, skip_special_tokens=True)
                out[f"chat: {question}"] = {"text": text, "accepted": accepts_answer(text)}
    model.train()
    return out


def save(model: StoryModel, tok, out_dir: Path, record: dict) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    s = model.shape
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = [tok.token_to_id(EOS), tok.token_to_id(IM_END)]
    config = s.config() | {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": eos}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in checkpoint_tensors(model.llama).items()
    }
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
        elif "accepted" in sample:
            print(f"[{name}: {'accepted' if sample['accepted'] else 'REFUSED'}] {sample['text']!r}")
        else:
            print(
                f"[{name}: {sample['calls_accepted']}/{sample['calls']} calls accepted] {sample['text']!r}"
            )
    print(f"checkpoint -> {args['out']}, loss curve -> {plot}")


if __name__ == "__main__":
    main()
