"""Offline throughput: one seeded workload (token-id prompts, per-request output lengths, no early
stop) through transformers' static-batch `generate()`, pdserve `static` and pdserve `continuous`,
in one process; prints output tokens/s, their ratios and a profile of pdserve's step loop.

    .venv/bin/python -m pdserve.bench.offline_throughput    # issue 3's workload, ~50M-parameter model

The default workload (128 requests, prompts 32-512, outputs 16-512) takes about 7 minutes for the
three systems on an idle 2-core CPU; a quicker one of the same shape halves every length:
    --min-prompt-len 16 --max-prompt-len 256 --min-output-len 8 --max-output-len 256

Against a peer engine (vLLM's CPU backend, in .venv-vllm from `make bench-peers`), pdserve and the
peer alternating round by round, each in a fresh process:
    .venv/bin/python -m pdserve.bench.offline_throughput --peer vllm --model llama-9m --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.bench.peers import driver
from pdserve.bench.peers import models as bench_models
from pdserve.bench.peers.competing_load import CompetingLoad
from pdserve.bench.peers.protocol import RoundRequest, RoundResult, machine_cpu_seconds
from pdserve.bench.peers.rounds import summary, table
from pdserve.bench.peers.variants import DEFAULT_LABEL, parse_variants
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.kv.kv_manager import KVCacheManager
from pdserve.tune import provenance

SYSTEMS = ("hf", "static", "continuous")
SYSTEM_NAMES = {
    "hf": "transformers generate (static batches)",
    "static": "pdserve static",
    "continuous": "pdserve continuous",
}
STEP_PARTS = ("schedule", "prepare", "model", "logits", "sample", "postprocess")


# --- workload and model -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int


def make_workload(args: argparse.Namespace) -> list[Request]:
    """Prompt and output lengths uniform in their ranges, token ids uniform over the vocabulary
    (above the special tokens), all from one seeded generator."""
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(args.min_prompt_len, args.max_prompt_len)
        output_len = rng.randint(args.min_output_len, args.max_output_len)
        prompt = [rng.randrange(4, args.vocab_size) for _ in range(prompt_len)]
        requests.append(Request(prompt, output_len))
    return requests


def model_config(args: argparse.Namespace) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden_size // args.heads,
        "max_position_embeddings": max(2048, args.max_prompt_len + args.max_output_len),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }


def write_model(out_dir: Path, cfg: dict, seed: int) -> None:
    """A random-weight checkpoint with the pdserve-tiny tokenizer files (prompts are token ids, so
    the tokenizer is only loaded, never used)."""
    from pdserve.engine.embedded.tiny import ensure_tiny_model, write_checkpoint

    write_checkpoint(out_dir, cfg, seed)
    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out_dir / name)


# --- results ------------------------------------------------------------------------------------


@dataclass(slots=True)
class StepProfile:
    """Seconds per part of the step loop, summed over steps (pdserve only)."""

    num_steps: int = 0
    num_seqs: int = 0  # scheduled sequences, summed over steps
    total_s: float = 0.0  # engine.stats.total_s: the whole step
    forward_s: float = 0.0  # engine.stats.forward_s: ModelRunner.run (prepare + model + logits)
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))

    @property
    def outside_forward(self) -> float:
        """Share of step time outside ModelRunner.run, as engine.stats reports it."""
        return 1 - self.forward_s / self.total_s if self.total_s else 0.0

    @property
    def outside_model(self) -> float:
        """Share of step time outside the model's own forward (and the lm_head)."""
        inside = self.parts["model"] + self.parts["logits"]
        return 1 - inside / self.total_s if self.total_s else 0.0

    def to_dict(self) -> dict:
        ms = 1e3 / max(1, self.num_steps)
        other = self.total_s - sum(self.parts.values())
        return {
            "num_steps": self.num_steps,
            "mean_batch": self.num_seqs / max(1, self.num_steps),
            "step_ms": self.total_s * ms,
            "parts_ms": {k: v * ms for k, v in self.parts.items()} | {"other": other * ms},
            "outside_forward_share": self.outside_forward,
            "outside_model_share": self.outside_model,
        }


@dataclass(slots=True)
class SystemResult:
    system: str
    elapsed_s: float
    output_tokens: int
    peak_batch: int = 0
    profile: dict | None = None
    cpu_s: float = 0.0  # this process's CPU time (all threads) over the run
    machine_cpu_s: float = 0.0  # the whole machine's busy CPU time over the run (all processes)
    load_1m: float = field(default_factory=lambda: os.getloadavg()[0])  # at the run's end

    @property
    def cpu_share(self) -> float:
        """CPU time / (wall time x threads): below 1 when other work took the cores."""
        return self.cpu_s / (self.elapsed_s * torch.get_num_threads())

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


# --- transformers -------------------------------------------------------------------------------


def run_hf(
    model_dir: Path, workload: list[Request], batch_size: int, progress: bool
) -> SystemResult:
    """Left-padded static batches in request order; each batch generates to its longest output
    (min_new_tokens = max_new_tokens, so nothing stops early); only requested tokens count."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()

    def generate(batch: list[Request]) -> None:
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )

    generate([Request([5, 6, 7], 4), Request([8, 9], 4)])  # warm-up
    batches = [workload[i : i + batch_size] for i in range(0, len(workload), batch_size)]
    bar = _progress(sum(r.output_len for r in workload), "hf", progress)
    start, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        generate(batch)
        bar(sum(r.output_len for r in batch))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(r.output_len for r in workload)
    return SystemResult("hf", elapsed, tokens, batch_size, cpu_s=cpu)


# --- pdserve ------------------------------------------------------------------------------------


class StepTimer:
    """Times each part of LLMEngine.step by wrapping the callables it goes through; undone by
    `close()`. The wrappers cost a few perf_counter calls per step."""

    def __init__(self, engine) -> None:
        import pdserve.engine.execution.executor as executor_module

        self.engine = engine
        self.profile = StepProfile()
        self._module = executor_module
        self._sample = executor_module.sample
        parts = self.profile.parts
        engine.scheduler.schedule = self._timed(engine.scheduler.schedule, "schedule", parts)
        engine.runner.prepare = self._timed(engine.runner.prepare, "prepare", parts)
        engine.model.forward = self._timed(engine.model.forward, "model", parts)
        engine.model.compute_logits = self._timed(engine.model.compute_logits, "logits", parts)
        engine.scheduler.postprocess = self._timed(
            engine.scheduler.postprocess, "postprocess", parts
        )
        executor_module.sample = self._timed(self._sample, "sample", parts)
        self._start = (engine.stats.num_steps, engine.stats.total_s, engine.stats.forward_s)

    @staticmethod
    def _timed(fn: Callable, name: str, parts: dict[str, float]) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += time.perf_counter() - t0

        return wrapper

    def reset(self) -> None:
        """Forget what was timed so far (e.g. warm-up steps)."""
        for name in STEP_PARTS:
            self.profile.parts[name] = 0.0
        self.profile.num_seqs = 0
        s = self.engine.stats
        self._start = (s.num_steps, s.total_s, s.forward_s)

    def close(self) -> StepProfile:
        e = self.engine
        for obj, name in (
            (e.scheduler, "schedule"),
            (e.runner, "prepare"),
            (e.model, "forward"),
            (e.model, "compute_logits"),
            (e.scheduler, "postprocess"),
        ):
            delattr(obj, name)
        self._module.sample = self._sample
        s = e.stats
        self.profile.num_steps = s.num_steps - self._start[0]
        self.profile.total_s = s.total_s - self._start[1]
        self.profile.forward_s = s.forward_s - self._start[2]
        return self.profile


def make_llm(
    model_dir: Path,
    policy: str,
    max_num_seqs: int,
    num_kv_blocks: int,
    block_size: int,
    engine_options: dict | None = None,
):
    """pdserve's offline engine for the benchmark; `engine_options`: other EngineConfig settings."""
    from pdserve.engine import LLM

    return LLM(
        str(model_dir),
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
        block_size=block_size,
        dtype="float32",
        device="cpu",
        enable_prefix_caching=False,  # random prompts share nothing; keep hashing out of the loop
        **(engine_options or {}),
    )


def kv_manager(model_dir: Path, block_size: int) -> KVCacheManager:
    """A KV manager of the model's KV groups (one, unless its layers mix kinds), for its count of
    a sequence's blocks; the one-block pool under it is never used."""
    from pdserve.engine.models.config import ModelConfig

    layout = KVLayout.for_model(ModelConfig.from_pretrained(model_dir), block_size, "float32")
    return KVCacheManager(BlockManager(1, block_size), layout.groups)


def blocks_for(lengths: list[int], kv: KVCacheManager) -> int:
    """Enough KV blocks for sequences of these lengths to be held at once, each computed in one
    chunk (every block of every KV group): no preemption in either policy."""
    return sum(kv.peak_blocks(n, n) for n in lengths) + 16


def run_pdserve(
    model_dir: Path,
    workload: list[Request],
    policy: str,
    max_num_seqs: int,
    block_size: int,
    progress: bool,
    engine_options: dict | None = None,
) -> SystemResult:
    from pdserve.engine import SamplingParams

    lengths = [len(r.prompt) + r.output_len for r in workload]
    num_blocks = blocks_for(lengths, kv_manager(model_dir, block_size))
    llm = make_llm(model_dir, policy, max_num_seqs, num_blocks, block_size, engine_options)
    engine = llm.engine
    timer = StepTimer(engine)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 7], [8, 9]], warm)
    timer.reset()
    bar = _progress(sum(r.output_len for r in workload), policy, progress)
    peak = 0
    busy, start, cpu = machine_cpu_seconds(), time.perf_counter(), time.process_time()
    for i, r in enumerate(workload):
        params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
        engine.add_request(f"bench-{i}", r.prompt, params)
    produced = 0
    while engine.has_unfinished():
        outputs = engine.step()
        peak = max(peak, len(engine.scheduler.running) + sum(o.finished for o in outputs))
        timer.profile.num_seqs += len(outputs)
        produced += len(outputs)
        bar(len(outputs))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    busy = machine_cpu_seconds() - busy
    profile = timer.close()
    expected = sum(r.output_len for r in workload)
    if produced != expected:
        raise RuntimeError(f"pdserve {policy} produced {produced} tokens, expected {expected}")
    return SystemResult(policy, elapsed, produced, peak, profile.to_dict(), cpu, busy)


def profile_decode_steps(
    model_dir: Path,
    workload: list[Request],
    num_seqs: int,
    num_steps: int,
    block_size: int,
    seed: int,
) -> dict:
    """The step loop with `num_seqs` sequences all decoding: they are handed in already prefilled
    (as a decode node takes in sequences whose KV arrived; the pages hold zeros, which costs the
    same), with prompt lengths drawn from the workload's, then `num_steps` steps are timed."""
    from pdserve.engine import SamplingParams
    from pdserve.engine.sequence import Sequence

    rng = random.Random(seed + 1)
    prompts = [rng.choice(workload).prompt for _ in range(num_seqs)]
    warmup = 2
    lengths = [len(p) + num_steps + warmup + 1 for p in prompts]
    need = blocks_for(lengths, kv_manager(model_dir, block_size))
    llm = make_llm(model_dir, "continuous", num_seqs, need, block_size)
    engine = llm.engine
    params = SamplingParams(max_tokens=num_steps + warmup + 1, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"decode-{i}", prompt + [rng.randrange(4, engine.vocab_size)], params)
        # Its prompt's KV taken in as a handoff's: each KV group's blocks its next query reads.
        if not engine.scheduler.kv.allocate_arriving(seq, len(prompt), 0):
            raise RuntimeError("the KV pool is too small for the decode profile")
        seq.num_computed_tokens = len(prompt)
        engine.seqs[seq.request_id] = seq
        engine.scheduler.add_running(seq)
    timer = StepTimer(engine)
    for _ in range(warmup):
        engine.step()
    timer.reset()
    for _ in range(num_steps):
        outputs = engine.step()
        if len(outputs) != num_seqs:
            raise RuntimeError(f"{len(outputs)} sequences decoded, expected {num_seqs}")
        timer.profile.num_seqs += len(outputs)
    profile = timer.close().to_dict()
    mean_ctx = sum(len(p) for p in prompts) / num_seqs + warmup + num_steps / 2
    return profile | {"num_seqs": num_seqs, "mean_context": mean_ctx}


# --- driver -------------------------------------------------------------------------------------


def _progress(total: int, desc: str, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda n: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="tok", leave=False, file=sys.stderr)

    def update(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()

    return update


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=128)
    w.add_argument("--min-prompt-len", type=int, default=32)
    w.add_argument("--max-prompt-len", type=int, default=512)
    w.add_argument("--min-output-len", type=int, default=16)
    w.add_argument("--max-output-len", type=int, default=512)
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model (random weights, Llama-shaped, float32)")
    m.add_argument("--hidden-size", type=int, default=512)
    m.add_argument("--layers", type=int, default=6)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=4)
    m.add_argument("--intermediate-size", type=int, default=1536)
    m.add_argument("--vocab-size", type=int, default=32000)
    s = p.add_argument_group("systems")
    s.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated subset of hf,static,continuous",
    )
    s.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    s.add_argument(
        "--static-batch-size",
        type=int,
        default=None,
        help="pdserve static's max_num_seqs (default: --hf-batch-size, the same batches as hf)",
    )
    s.add_argument("--max-num-seqs", type=int, default=256, help="pdserve continuous")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--repeats", type=int, default=1, help="runs per system; the best is kept")
    s.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    s.add_argument(
        "--profile-seqs", type=int, default=256, help="decoding sequences to profile (0: skip)"
    )
    s.add_argument("--profile-steps", type=int, default=16)
    m.add_argument(
        "--model",
        default=None,
        help="a bench model (" + ", ".join(bench_models.MODELS) + ") or a checkpoint directory, "
        "instead of the shape above (its vocabulary bounds the prompts' token ids)",
    )
    q = p.add_argument_group("peer (instead of the systems above)")
    q.add_argument(
        "--peer",
        choices=driver.PEERS,
        default=None,
        help="run pdserve continuous and this engine, alternating round by round, each in a "
        "fresh process (vllm: its CPU backend from .venv-vllm, see `make bench-peers`)",
    )
    q.add_argument("--rounds", type=int, default=3, help="rounds of the peer comparison")
    q.add_argument(
        "--pdserve-variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="also run pdserve with these engine flags (--cpu-threads, --cpu-bind, "
        "--[no-]compile, --cpu-linear) in every round, e.g. 'one-bound=--cpu-threads 1 --cpu-bind 0'; "
        "repeatable",
    )
    q.add_argument(
        "--peer-venv",
        type=Path,
        default=driver.VLLM_VENV,
        help="the peer's virtualenv (default: .venv-vllm in the checkout, from `make bench-peers`)",
    )
    p.add_argument(
        "--competing-load",
        type=int,
        default=0,
        metavar="N",
        help="N busy-loop processes running beside the benchmark the whole time",
    )
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.peer and (why := driver.missing_peer(args.peer, args.peer_venv)):
        raise SystemExit(f"pdserve.bench.offline_throughput: error: {why}")
    if args.pdserve_variant and not args.peer:
        p.error("--pdserve-variant needs --peer")
    try:
        args.variants = parse_variants(args.pdserve_variant, args.peer or "")
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.competing_load < 0:
        p.error("--competing-load must be 0 or more")
    args.systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    for name in args.systems:
        if name not in SYSTEMS:
            p.error(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    if args.static_batch_size is None:
        args.static_batch_size = args.hf_batch_size
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    record = provenance.start(sys.argv if argv is None else [__file__, *argv])
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        if args.model:
            model_dir = bench_models.resolve(args.model)
            cfg = bench_models.checkpoint_config(model_dir)
            args.vocab_size = cfg["vocab_size"]
        else:
            model_dir, cfg = Path(tmp) / "model", model_config(args)
            model_dir.mkdir()
            write_model(model_dir, cfg, args.seed)
        workload = make_workload(args)
        print(f"command: {record['command']}")
        print(f"model: {describe_model(cfg)}")
        print(
            f"workload: {len(workload)} requests, prompts {args.min_prompt_len}-"
            f"{args.max_prompt_len} ({sum(len(r.prompt) for r in workload)} tokens), outputs "
            f"{args.min_output_len}-{args.max_output_len} "
            f"({sum(r.output_len for r in workload)} tokens), seed {args.seed}, greedy, ignore_eos"
        )
        if args.competing_load:
            print(f"competing load: {args.competing_load} busy-loop processes")
        with CompetingLoad(args.competing_load):
            if args.peer:
                report = run_peer(args, model_dir, workload, Path(tmp))
            else:
                report = run_systems(args, model_dir, workload)
    report = (
        provenance.finish(record)
        | {
            "torch_threads": torch.get_num_threads(),
            "model": cfg | {"num_parameters": bench_models.num_parameters(cfg)},
            "workload": {
                "num_requests": len(workload),
                "prompt_tokens": sum(len(r.prompt) for r in workload),
                "output_tokens": sum(r.output_len for r in workload),
            },
            # (the variants' flags are in the report's "variants")
            "args": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k != "variants"
            },
        }
        | report
    )
    if not args.peer:
        print("\n" + systems_table(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return report


# --- the docs' tables -----------------------------------------------------------------------------

DOCS_NAMES = {
    "hf": "transformers `generate()`, static batches of {hf_batch_size}",
    "static": "pdserve static (batches of {static_batch_size})",
    "continuous": "pdserve continuous",
}


def systems_table(results: dict) -> str:
    """Each system's output tokens/s, time, peak batch and CPU share, then the ratios."""
    lines = [
        "| system | output tok/s | time (s) | peak batch | CPU share |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results["results"].items():
        rate = f"{r['tokens_per_s']:.1f}"
        lines.append(
            f"| {DOCS_NAMES[name].format(**results['args'])} | "
            f"{f'**{rate}**' if name == 'continuous' else rate} | {r['elapsed_s']:.1f} | "
            f"{r['peak_batch']} | {r['cpu_share']:.0%} |"
        )
    ratios = [f"{k.replace('/', ' / ')} = {v:.2f}x" for k, v in results["ratios"].items()]
    if ratios:
        ratios[0] = f"**{ratios[0]}**"
        lines += ["", ", ".join(ratios) + "."]
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{value:.0f} ms" if value >= 10 else f"{value:.2f} ms"


def step_loop_table(results: dict) -> str:
    """The decode profile: time per step and its parts at the profiled number of sequences, and
    the share outside the model forward."""
    p = results["decode_profile"]
    parts = p["parts_ms"]
    names = {
        "model": "model forward",
        "logits": "lm_head (logits)",
        "schedule": "schedule",
        "prepare": "prepare (tensors from the scheduler output)",
        "sample": "sample (greedy)",
        "postprocess": "postprocess",
        "other": "rest of step",
    }
    outside = p["step_ms"] * p["outside_model_share"]
    lines = [
        f"| at {p['num_seqs']} decoding sequences (mean context {p['mean_context']:.0f}) | time |",
        "| --- | ---: |",
        f"| step | {_ms(p['step_ms'])} |",
        *(f"| {label} | {_ms(parts[key])} |" for key, label in names.items()),
        f"| **outside `ModelRunner.run`** (engine.stats) | {p['outside_forward_share']:.2%} |",
        f"| **outside model forward + lm_head** | {p['outside_model_share']:.2%} "
        f"({_ms(outside)}) |",
    ]
    return "\n".join(lines)


def describe_model(cfg: dict) -> str:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    count = bench_models.num_parameters(cfg)
    size = "parameters not counted" if count is None else f"{count / 1e6:.1f}M parameters"
    return (
        f"{size} ({cfg['model_type']}, hidden "
        f"{h}, {cfg['num_hidden_layers']} layers, {heads} heads / "
        f"{cfg['num_key_value_heads']} kv heads of {cfg.get('head_dim') or h // heads}, "
        f"intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']}"
        f"{', tied lm_head' if cfg.get('tie_word_embeddings') else ''}), float32"
    )


def run_peer(args: argparse.Namespace, model_dir: Path, workload: list[Request], tmp: Path) -> dict:
    """pdserve continuous against the peer, alternating round by round in fresh processes."""

    def show(run) -> None:
        r = run.result
        print(
            f"round {run.round} {r.engine:<8} {r.tokens_per_s:8.1f} tok/s ({r.output_tokens} "
            f"tokens in {r.elapsed_s:.1f} s, CPU share {run.cpu_share:.0%}, other work's CPU "
            f"share {run.others_share:.0%}, load {run.load_1m:.1f})",
            flush=True,
        )

    requests = [RoundRequest(r.prompt, r.output_len) for r in workload]
    runs = driver.run_rounds(
        args.peer,
        model_dir,
        requests,
        args.rounds,
        args.max_num_seqs,
        args.block_size,
        tmp,
        on_run=show,
        venv=args.peer_venv,
        variants=args.variants,
    )
    for variant in args.variants:
        print()
        if variant.flags:
            print(f"{variant.label}: pdserve {shlex.join(variant.flags)}")
        print(table(runs, variant.label, args.peer))
    return {
        "peer": args.peer,
        "competing_load": args.competing_load,
        "rounds": [
            {"round": r.round, "load_1m": r.load_1m, "cpu_share": r.cpu_share}
            | {"others_share": r.others_share}
            | {k: getattr(r.result, k) for k in RoundResult.__slots__}
            for r in runs
        ],
        "summary": summary(runs, DEFAULT_LABEL, args.peer),
        "variants": {
            v.label: {"flags": list(v.flags)} | summary(runs, v.label, args.peer)
            for v in args.variants[1:]
        },
    }


def run_systems(args: argparse.Namespace, model_dir: Path, workload: list[Request]) -> dict:
    """hf, static and continuous in this process, in alternating order per repeat."""
    progress = not args.no_progress and sys.stderr.isatty()
    results: dict[str, SystemResult] = {}
    runs: dict[str, list[float]] = {}
    decode_profile = None
    # Repeats alternate the order (hf, static, continuous, then backwards) so that drift in
    # what else the machine runs falls on every system alike; each keeps its best run.
    for rep in range(args.repeats):
        for name in args.systems if rep % 2 == 0 else args.systems[::-1]:
            if name == "hf":
                res = run_hf(model_dir, workload, args.hf_batch_size, progress)
            else:
                seqs = args.max_num_seqs if name == "continuous" else args.static_batch_size
                res = run_pdserve(model_dir, workload, name, seqs, args.block_size, progress)
            runs.setdefault(name, []).append(res.elapsed_s)
            if name not in results or res.elapsed_s < results[name].elapsed_s:
                results[name] = res
            print(
                f"{SYSTEM_NAMES[name]:<40} {res.tokens_per_s:8.1f} tok/s "
                f"({res.output_tokens} tokens in {res.elapsed_s:.1f} s, "
                f"peak batch {res.peak_batch}, CPU share {res.cpu_share:.0%}, "
                f"load {res.load_1m:.1f})",
                flush=True,
            )
    if args.profile_seqs:
        decode_profile = profile_decode_steps(
            model_dir,
            workload,
            args.profile_seqs,
            args.profile_steps,
            args.block_size,
            args.seed,
        )
    print()
    for name, res in results.items():
        print(f"best {SYSTEM_NAMES[name]:<35} {res.tokens_per_s:8.1f} tok/s")
    ratios = {}
    for a, b in (("continuous", "hf"), ("static", "hf"), ("continuous", "static")):
        if a in results and b in results:
            ratios[f"{a}/{b}"] = results[a].tokens_per_s / results[b].tokens_per_s
            print(f"ratio {a}/{b}: {ratios[f'{a}/{b}']:.2f}x")
    for name, res in results.items():
        if res.profile:
            _print_profile(f"{name} step loop, whole run", res.profile)
    if decode_profile:
        _print_profile(
            f"step loop at {decode_profile['num_seqs']} decoding sequences "
            f"(mean context {decode_profile['mean_context']:.0f})",
            decode_profile,
        )
    return {
        "results": {
            k: asdict(v)
            | {"tokens_per_s": v.tokens_per_s, "cpu_share": v.cpu_share, "all_elapsed_s": runs[k]}
            for k, v in results.items()
        },
        "ratios": ratios,
        "decode_profile": decode_profile,
    }


def _print_profile(title: str, profile: dict) -> None:
    parts = " ".join(f"{k} {v:.1f}" for k, v in profile["parts_ms"].items())
    print(
        f"{title}: {profile['num_steps']} steps, mean batch {profile['mean_batch']:.0f}, "
        f"{profile['step_ms']:.1f} ms/step [{parts} ms]; outside ModelRunner.run "
        f"{profile['outside_forward_share']:.1%}, outside the model forward "
        f"{profile['outside_model_share']:.1%}"
    )


if __name__ == "__main__":
    main()
