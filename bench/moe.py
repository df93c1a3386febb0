"""The mixture-of-experts layer against a dense MLP with the same active parameters, in one run on
one device: for each token count, the time of the MoE MLP (router, the op table's `fused_moe`,
combine) with each kernel backend at hand, and of a gated MLP k experts wide. On CUDA the Triton
MoE and the dense MLP are timed as CUDA-graph replays (as decode steps run them; `triton_eager`
launched from Python beside it), the torch reference eagerly (it reads expert counts on the host
and cannot be captured).

    python -m pdserve.bench.moe                                  # CPU: the torch reference
    python -m pdserve.bench.moe --device cuda --json moe.json    # GPU: Triton and reference
    python -m pdserve.bench.moe --quick                          # fewer token counts
    python -m pdserve.bench.moe --shape deepseek-v3 --tokens 1,2,4,8   # 256 experts of 2048

The default shape is Qwen3-30B-A3B's layer on CUDA (hidden 2048, 128 experts of 768, top-8,
bfloat16) and the bench model mixtral-55m's on CPU (hidden 384, 8 experts of 512, top-2,
float32). Routing is a random router's: close to uniform over the experts. On CUDA each row
also gives the active FLOPs per second as a fraction of a square bfloat16 matmul measured in the
same run, and the bytes of the experts the tokens touch per second as a fraction of a device copy.
The quick run on CUDA times 1, 2, 4 and 8 tokens (the split-K schedule of
`kernels/triton_moe_small.py`; `make gpu-check`'s aim "fused MoE, 1-8 tokens" reads their share of
copy) beside 64 and 2048 (the grouped GEMM).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.bench.kernels import graph_time_ms
from pdserve.bench.model_step import measure_limits, median_ms
from pdserve.engine.cpu import linear as cpu_linear
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.llama import MLP
from pdserve.engine.models.moe import SparseMoE
from pdserve.engine.tp.shard import TPShard
from pdserve.kernels.ops import REFERENCE, select_ops
from pdserve.tune import provenance

SHAPES = {
    # hidden, expert width, experts, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),  # 22.5 GB of bfloat16 experts: an 80 GB GPU or more
    "mixtral-55m": (384, 512, 8, 2),
}


@dataclass(frozen=True, slots=True)
class Row:
    tokens: int
    dense_ms: float  # a gated MLP of k x width columns: the same active parameters
    dense_onednn_ms: float | None  # CPU: that MLP on weights packed for oneDNN
    moe_ms: dict[str, float]  # by kernel backend (triton_eager on CUDA; onednn: packed experts)
    experts_touched: int  # distinct experts the tokens were routed to
    active_tflop: float  # the active matmuls' FLOPs (router included)
    fraction_of_matmul: dict[str, float]  # CUDA only
    fraction_of_copy: dict[str, float]  # CUDA only: touched experts' bytes / time vs a copy


def layer(shape: tuple[int, int, int, int], device: str, dtype: torch.dtype, seed: int):
    """A random MoE layer and the dense MLP with its active parameters."""
    hidden, width, experts, top_k = shape
    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 1,
            "hidden_size": hidden,
            "intermediate_size": top_k * width,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": width,
            "norm_topk_prob": True,
        }
    )
    torch.manual_seed(seed)
    with torch.device(device):
        moe = SparseMoE(cfg, TPShard(), None, MLP).to(dtype)
        dense = MLP(cfg, TPShard(), None).to(dtype)
    with torch.no_grad():
        for module in (moe, dense):
            for p in module.parameters():
                p.normal_(0, hidden**-0.5)
    return moe.eval(), dense.eval()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.moe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    record = provenance.start(sys.argv if argv is None else ["bench/moe.py", *argv])
    cuda = args.device.startswith("cuda")
    shape = SHAPES[args.shape or ("qwen3-30b-a3b" if cuda else "mixtral-55m")]
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if args.tokens:
        counts = [int(t) for t in args.tokens.split(",")]
    elif args.quick:
        counts = [1, 2, 4, 8, 64, 2048] if cuda else [1, 64, 512]
    else:
        counts = [1, 16, 64, 256, 2048, 8192] if cuda else [1, 16, 64, 256, 1024]
    repeats = args.repeats or (20 if cuda else 5)
    backends = {"torch": REFERENCE}
    if cuda:
        backends["triton"] = select_ops(args.device, "triton")
    moe, dense = layer(shape, args.device, dtype, seed=0)
    packed = None  # a CPU node's layers: every matrix packed for oneDNN (float32)
    if not cuda and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        packed = layer(shape, args.device, dtype, seed=0)
        for module in packed:
            cpu_linear.pack(module)
    hidden, width, num_experts, top_k = shape
    expert_bytes = 3 * hidden * width * dtype.itemsize
    copy = matmul = None
    if cuda:
        limits = measure_limits(args.device, dtype, 1 << 30, 8192, repeats)
        copy, matmul = limits.copy_gbps, limits.matmul_tflops
    rows = []
    with torch.inference_mode():
        for n in counts:
            x = torch.randn(n, hidden, device=args.device, dtype=dtype)
            _, ids = torch.topk(moe.gate(x).float(), top_k, dim=-1)
            touched = int(torch.unique(ids).numel())
            flop = 2.0 * n * (top_k * 3 * hidden * width + hidden * num_experts)
            times = {
                name: median_ms(lambda ops=ops, x=x: moe(x, ops), args.device, repeats)
                for name, ops in backends.items()
            }
            if cuda:  # as decode steps run it: replayed from a CUDA graph, no launch overhead
                times["triton_eager"] = times.pop("triton")
                times["triton"] = graph_time_ms([lambda x=x: moe(x, backends["triton"])] * 4, 10)
                dense_ms = graph_time_ms([lambda x=x: dense(x)] * 4, 10)
            else:
                dense_ms = median_ms(lambda x=x: dense(x), args.device, repeats)
            dense_onednn_ms = None
            if packed is not None:
                times["onednn"] = median_ms(
                    lambda x=x: packed[0](x, REFERENCE), args.device, repeats
                )
                dense_onednn_ms = median_ms(lambda x=x: packed[1](x), args.device, repeats)
            rows.append(
                Row(
                    tokens=n,
                    dense_ms=dense_ms,
                    dense_onednn_ms=dense_onednn_ms,
                    moe_ms=times,
                    experts_touched=touched,
                    active_tflop=flop / 1e12,
                    fraction_of_matmul={
                        k: flop / (ms * 1e-3) / 1e12 / matmul for k, ms in times.items()
                    }
                    if cuda
                    else {},
                    fraction_of_copy={
                        k: touched * expert_bytes / (ms * 1e-3) / 1e9 / copy
                        for k, ms in times.items()
                    }
                    if cuda
                    else {},
                )
            )
    result = provenance.finish(record) | {
        "device": torch.cuda.get_device_name() if cuda else provenance.cpu_model(),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": dict(zip(("hidden", "expert_width", "experts", "top_k"), shape)),
        "threads": torch.get_num_threads(),
        "copy_gbps": copy,
        "matmul_tflops": matmul,
        "rows": [asdict(r) for r in rows],
    }
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def render(result: dict) -> str:
    s = result["shape"]
    lines = [
        f"{result['device']}, {result['dtype']}: hidden {s['hidden']}, {s['experts']} experts of "
        f"{s['expert_width']}, top-{s['top_k']}; dense MLP {s['top_k'] * s['expert_width']} wide"
    ]
    if result["copy_gbps"]:
        lines.append(
            f"copy {result['copy_gbps']:.0f} GB/s, matmul {result['matmul_tflops']:.0f} TFLOP/s"
        )
    return "\n".join([*lines, docs_table(result)])


def docs_table(result: dict) -> str:
    """The table of a run: on CUDA the Triton MoE (graph and eager) and the reference beside the
    dense MLP, in µs; on CPU the reference and the oneDNN-packed path beside the dense MLP run
    the same two ways, in ms."""
    rows = result["rows"]
    if result["copy_gbps"]:  # a GPU run
        head = [
            "tokens",
            "experts hit",
            "dense µs (graph)",
            "Triton µs (graph)",
            "Triton µs (eager)",
            "torch ref µs",
            "Triton / dense",
            "of matmul",
            "of copy",
        ]
        body = [
            [
                r["tokens"],
                r["experts_touched"],
                f"{r['dense_ms'] * 1e3:.0f}",
                f"{r['moe_ms']['triton'] * 1e3:.0f}",
                f"{r['moe_ms']['triton_eager'] * 1e3:.0f}",
                f"{r['moe_ms']['torch'] * 1e3:.0f}",
                f"{r['moe_ms']['triton'] / r['dense_ms']:.1f}",
                f"{r['fraction_of_matmul']['triton']:.0%}",
                f"{r['fraction_of_copy']['triton']:.0%}",
            ]
            for r in rows
        ]
    else:
        packed = bool(rows) and rows[0].get("dense_onednn_ms") is not None
        head = ["tokens", "experts hit", "dense ms"]
        head += ["dense ms, packed"] if packed else []
        head += ["MoE ms, torch reference"] + (["MoE ms, packed"] if packed else [])
        head += ["reference / dense"] + (["packed / dense packed"] if packed else [])
        body = []
        for r in rows:
            cells = [r["tokens"], r["experts_touched"], f"{r['dense_ms']:.3f}"]
            cells += [f"{r['dense_onednn_ms']:.3f}"] if packed else []
            cells += [f"{r['moe_ms']['torch']:.3f}"]
            cells += [f"{r['moe_ms']['onednn']:.3f}"] if packed else []
            cells += [f"{r['moe_ms']['torch'] / r['dense_ms']:.2f}"]
            cells += [f"{r['moe_ms']['onednn'] / r['dense_onednn_ms']:.2f}"] if packed else []
            body.append(cells)
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in cells) + " |" for cells in body]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.exit(0)
