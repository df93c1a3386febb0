"""How fine an FP8 KV cache's scales need to be, measured offline on the K, V and queries a
model's prefill computes (float32, captured from transformers' attention of the same checkpoint):
each granularity's relative error of K, of V, and of the attention output over the quantized
cache against the float one, beside the bytes one token's KV takes with it.

Granularities (one float32 scale = its group's largest magnitude / 448 unless static):

- `token` (what `--kv-cache-dtype fp8` ships): one scale per (token, KV head), in the page row;
- `block`: one per (block of 16 tokens, KV head), dynamic over the block's tokens;
- `head static`: one per (layer, K/V, KV head), the largest magnitude over a calibration set of
  prompts (not those measured), values beyond it clamped;
- `layer static`: one per (layer, K/V), over every head (vLLM's per-tensor `k_scale`/`v_scale`);
- `scale 1.0`: no scale (vLLM's default when a checkpoint carries none).

The attention error is one layer's attention over the quantized cache with the float model's
queries: what the cache alone costs a layer, before errors carry from layer to layer (what
`bench.kv_fp8` measures end to end for the shipped choice).

    python -m pdserve.bench.kv_fp8_scales
    python -m pdserve.bench.kv_fp8_scales --model llama-50m --text random \
        --json-out bench/results/kv_fp8_scales_llama-50m.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.bench.kv_fp8 import model_path
from pdserve.kernels.kv_fp8_ref import FP8_MAX, SCALE_BYTES, dequantize_rows, quantize_rows
from pdserve.tune import provenance

PROG = "pdserve.bench.kv_fp8_scales"
BLOCK_SIZE = 16
GRANULARITIES = ("token", "block", "head static", "layer static", "scale 1.0")
TEXTS = ("corpus", "random")
CAPTURE = "pdserve_kv_capture"


def fake_quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x over `scale` rounded to float8_e4m3fn (clamped to +-448), times `scale` again."""
    fp8 = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8.float() * scale


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, 1.0 where a group is all zeros (as the shipped rows do)."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def per_token(x: torch.Tensor) -> torch.Tensor:
    """x [heads, tokens, head_dim] through the shipped page rows (kernels.kv_fp8_ref)."""
    return dequantize_rows(quantize_rows(x), torch.float32)


def per_block(x: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """x [heads, tokens, head_dim] with one scale per (block of `block_size` tokens, head): the
    largest magnitude of the tokens the block holds (the last block's, those it has)."""
    heads, tokens, dim = x.shape
    blocks = math.ceil(tokens / block_size)
    padded = F.pad(x, (0, 0, 0, blocks * block_size - tokens))
    grouped = padded.view(heads, blocks, block_size, dim)
    scale = amax_scale(grouped.abs().amax(dim=(2, 3), keepdim=True))
    return fake_quantize(grouped, scale).view(heads, -1, dim)[:, :tokens]


def bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = BLOCK_SIZE
) -> dict[str, float]:
    """One token's K and V over every layer with each granularity's scales: a static scale is
    the model's, not the token's (2 x layers x heads x 4 bytes in all)."""
    values = 2 * num_layers * num_kv_heads * head_dim
    rows = 2 * num_layers * num_kv_heads
    return {
        "token": values + rows * SCALE_BYTES,
        "block": values + rows * SCALE_BYTES / block_size,
        "head static": values,
        "layer static": values,
        "scale 1.0": values,
        "bfloat16": 2 * values,
    }


class Capture:
    """transformers' attention of a model, recording each layer's query, key and value
    ([heads, tokens, head_dim], float32, after rotary embedding) and its softmax scale."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):  # noqa: ANN001, ANN204
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.layers.append((query[0].float(), key[0].float(), value[0].float(), float(scaling)))
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )


def capture_prefills(model_dir: str, prompts: list[list[int]]) -> list[list[tuple]]:
    """Each prompt's prefill through the checkpoint in float32: per prompt, per layer, (query,
    key, value, scaling)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    capture = Capture()
    AttentionInterface.register(CAPTURE, capture)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=CAPTURE
    )
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            capture.layers = []
            model(torch.tensor([prompt]), use_cache=False)
            out.append(capture.layers)
    return out


def calibrate(prefills: list[list[tuple]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the largest magnitude of K and of V per KV head over the calibration
    prompts."""
    amax = []
    for layer in range(len(prefills[0])):
        ks = torch.stack([p[layer][1].abs().amax(dim=(1, 2)) for p in prefills]).amax(dim=0)
        vs = torch.stack([p[layer][2].abs().amax(dim=(1, 2)) for p in prefills]).amax(dim=0)
        amax.append((ks, vs))
    return amax


def quantizers(layer_amax: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple]:
    """Each granularity's quantizer of a layer's K and of its V."""
    k_head, v_head = (amax_scale(a).view(-1, 1, 1) for a in layer_amax)
    k_layer, v_layer = (amax_scale(a.amax()) for a in layer_amax)
    return {
        "token": (per_token, per_token),
        "block": (per_block, per_block),
        "head static": (
            lambda k: fake_quantize(k, k_head),
            lambda v: fake_quantize(v, v_head),
        ),
        "layer static": (
            lambda k: fake_quantize(k, k_layer),
            lambda v: fake_quantize(v, v_layer),
        ),
        "scale 1.0": (lambda k: fake_quantize(k, 1.0), lambda v: fake_quantize(v, 1.0)),
    }


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """Causal attention of [heads, tokens, head_dim] queries over grouped KV heads."""
    groups = query.shape[0] // key.shape[0]
    key, value = key.repeat_interleave(groups, 0), value.repeat_interleave(groups, 0)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)


class ErrorSums:
    """Squared errors and squared norms, summed: the relative error is sqrt(err / norm)."""

    def __init__(self) -> None:
        self.err: dict[str, float] = {}
        self.norm: dict[str, float] = {}

    def add(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.err[name] = self.err.get(name, 0.0) + float((got - want).pow(2).sum())
        self.norm[name] = self.norm.get(name, 0.0) + float(want.pow(2).sum())

    def relative(self, name: str) -> float:
        return math.sqrt(self.err[name] / self.norm[name])


def compare(prefills: list[list[tuple]], amax: list[tuple]) -> dict[str, dict]:
    """Each granularity's relative error of K, V and the attention output over `prefills`,
    over all layers and per layer."""
    total = {g: ErrorSums() for g in GRANULARITIES}
    layers = [{g: ErrorSums() for g in GRANULARITIES} for _ in amax]
    for prefill in prefills:
        for index, (query, key, value, scaling) in enumerate(prefill):
            want = attention(query, key, value, scaling)
            for name, (quant_k, quant_v) in quantizers(amax[index]).items():
                k, v = quant_k(key), quant_v(value)
                got = attention(query, k, v, scaling)
                for sums in (total[name], layers[index][name]):
                    sums.add("K", k, key)
                    sums.add("V", v, value)
                    sums.add("attention", got, want)
    return {
        name: {
            "K": total[name].relative("K"),
            "V": total[name].relative("V"),
            "attention": total[name].relative("attention"),
            "attention_worst_layer": max(layer[name].relative("attention") for layer in layers),
        }
        for name in GRANULARITIES
    }


def random_prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def corpus_prompts(model_dir: str, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Documents of pdserve-stories' corpus grammar (a seed other than its training run's 0),
    tokenized by the model's tokenizer, cut to a random length in [lo, hi]; shorter ones
    skipped."""
    from pdserve.bench.stories.corpus import documents
    from pdserve.engine.tokenizer import Tokenizer

    tokenizer, rng, out = Tokenizer(model_dir), random.Random(seed), []
    for doc in documents(seed + 1000):
        ids = tokenizer.encode(doc)
        if len(ids) >= lo:
            out.append(ids[: rng.randrange(lo, hi + 1)])
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def measure(args: argparse.Namespace) -> dict:
    from pdserve.engine.embedded.catalog import resolve_model_dir

    model_dir = str(resolve_model_dir(model_path(args.model)))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    n = args.calibration + args.prompts
    if args.text == "corpus":
        prompts = corpus_prompts(model_dir, n, *args.prompt_len, args.seed)
    else:
        prompts = random_prompts(config["vocab_size"], n, *args.prompt_len, args.seed)
    prefills = capture_prefills(model_dir, prompts)
    amax = calibrate(prefills[: args.calibration])
    measured = prefills[args.calibration :]
    _, key, _, _ = measured[0][0]
    layers, heads, head_dim = len(measured[0]), key.shape[0], key.shape[-1]
    sizes = bytes_per_token(layers, heads, head_dim)
    errors = compare(measured, amax)
    return {
        "model": args.model,
        "text": args.text,
        "prompts": args.prompts,
        "calibration_prompts": args.calibration,
        "prompt_len": list(args.prompt_len),
        "tokens": sum(prefill[0][1].shape[1] for prefill in measured),
        "layout": {"num_layers": layers, "num_kv_heads": heads, "head_dim": head_dim},
        "block_size": BLOCK_SIZE,
        "granularities": {
            name: {
                **{k: round(v, 6) for k, v in errors[name].items()},
                "bytes_per_token": sizes[name],
                "over_bf16_bytes": round(sizes[name] / sizes["bfloat16"], 4),
            }
            for name in GRANULARITIES
        },
        "bfloat16_bytes_per_token": sizes["bfloat16"],
    }


# --- the docs' table (`python -m pdserve.bench.docs` renders it from the results files) -------


def docs_table(*results: dict) -> str:
    """Each run's granularities: relative errors of K, V and the attention output, and bytes."""
    out = [
        "| model (text) | scales | K rel. error | V rel. error | attention rel. error "
        "| worst layer's | bytes / token | of bf16 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for res in results:
        for name, row in res["granularities"].items():
            out.append(
                f"| {res['model']} ({res['text']}) | {name} | {row['K']:.4f} | {row['V']:.4f} "
                f"| {row['attention']:.4f} | {row['attention_worst_layer']:.4f} "
                f"| {row['bytes_per_token']:g} | {row['over_bf16_bytes']:.4f} |"
            )
    return "\n".join(out)


def _relative_span(rows: dict[str, dict], what: str) -> str:
    """Every other granularity's error of `what` over the per-token one's: least to most."""
    ratios = [row[what] / rows["token"][what] for name, row in rows.items() if name != "token"]
    lo, hi = f"{min(ratios):.2f}x", f"{max(ratios):.2f}x"
    return lo if lo == hi else f"{lo} to {hi}"


def docs_points(*results: dict) -> str:
    """Each run's winner by attention error, and every other granularity's errors relative to
    the shipped per-token scales', in words."""
    lines = []
    for res in results:
        rows = res["granularities"]
        best = min(rows, key=lambda g: rows[g]["attention"])
        lines.append(
            f"- **{res['model']} ({res['text']} text, {res['prompts']} prompts, "
            f"{res['tokens']:,} tokens): `{best}` has the least attention error** "
            f"({rows[best]['attention']:.4f}). Against the per-token scales, the other "
            f"granularities' errors are {_relative_span(rows, 'K')} on K, "
            f"{_relative_span(rows, 'V')} on V and {_relative_span(rows, 'attention')} on the "
            "attention output."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="pdserve-stories", help="an embedded or bench model, or a directory"
    )
    parser.add_argument(
        "--text",
        choices=TEXTS,
        default="corpus",
        help="corpus: pdserve-stories' grammar, tokenized; random: random token ids",
    )
    parser.add_argument("--prompts", type=int, default=64, help="prompts measured")
    parser.add_argument(
        "--calibration", type=int, default=16, help="other prompts, for the static scales"
    )
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256), metavar=("LO", "HI"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    record = provenance.start(sys.argv if argv is None else ["python", "-m", PROG, *argv])
    measured = measure(args)
    results = provenance.finish(record) | measured
    print(docs_table(measured))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
