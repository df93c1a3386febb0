"""Step `serving`: a disaggregated cluster on the one GPU. `pdserve serve` starts 1 prefill and 1
decode node over `cuda_ipc` and then over `tcp` (GPU pages staged through pinned memory) on a
random-weight Llama of about 1B parameters in bfloat16; each request's token stream, one request
at a time, must equal the offline engine's greedy output on the same GPU token for token, and
those outputs must be float32's choices within `BF16_TOLERANCE_NATS` (transformers in float32
fed the same tokens); then a short `pdserve.bench.serve_load` run gives TTFT, TPOT and throughput.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.deploy.gpu_check import deps
from pdserve.deploy.gpu_check.record import Deadline, StepRecord, step_args

# Llama-3.2-1B's layers (16 x hidden 2048, 32 q / 8 KV heads of 64, MLP 8192) with pdserve-tiny's
# tokenizer: 0.97 B parameters, nearly all in the layers.
MODEL_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}
# The same engine settings offline and on both nodes, so both run the same kernels on the same
# shapes: the 512-token chunk splits the long prompts, graphs cover the load's batches of 32.
ENGINE = {
    "num_kv_blocks": 4096,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 64,
    "cuda_graph_max_batch_size": 32,
    "max_model_len": 4096,
}
PROMPT_LENS = [5, 40, 200, 700, 1500]
NEW_TOKENS = 32
TRANSPORTS = ("cuda_ipc", "tcp")
LOAD = {"num_requests": 96, "max_concurrency": 32, "prompt_len": "64:512", "output_len": "32:128"}


def write_model(target: Path) -> dict:
    """A ~1B Llama checkpoint, weights N(0, 0.02) drawn on the GPU (fast), norms one."""
    import torch
    from safetensors.torch import save_file

    from pdserve.engine.embedded.tiny import TINY_CONFIG, ensure_tiny_model, random_llama_weights

    tiny = ensure_tiny_model()
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, target / name)
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    cfg = {**TINY_CONFIG, **MODEL_SHAPE, "vocab_size": vocab}
    try:  # the checkpoint's names and shapes, without drawing 1B numbers on the CPU
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in random_llama_weights(cfg, seed=0).items()}
    except RuntimeError:
        shapes = {k: v.shape for k, v in random_llama_weights(cfg, seed=0).items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.empty(shape, device="cuda").normal_(0.0, 0.02, generator=gen)
            weights[name] = w.to(torch.bfloat16).cpu()
    save_file(weights, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (target / "generation_config.json").write_text(json.dumps(gen_cfg))
    return {"parameters": sum(s.numel() for s in shapes.values()), "vocab_size": vocab}


def prompts(vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in PROMPT_LENS]


def offline_reference(model: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the offline engine on this GPU, one prompt at a time."""
    import torch

    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(model), device="cuda", dtype="bfloat16", **ENGINE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = [llm.generate([p], params)[0].token_ids for p in prompt_ids]
    del llm
    torch.cuda.empty_cache()
    return outs


# How far a bfloat16 greedy token may sit below float32's best, in nats of float32's log-softmax
# over the same context: on random weights of this scale bfloat16's choices sit within 0.02 nats
# of float32's best (measured on CPU), a random token about 1.2 below (the median), so a quarter
# of a nat tells rounding from a wrong path.
BF16_TOLERANCE_NATS = 0.25


def float32_gaps(
    model: Path, prompt_ids: list[list[int]], outputs: list[list[int]], device: str = "cuda"
) -> list[float]:
    """For every output token, how far below float32's best it sits (nats), with transformers'
    float32 model fed the prompt and the outputs before it: 0 where float32 chose it too."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    gaps = []
    with torch.no_grad():
        for prompt, out in zip(prompt_ids, outputs):
            ids = torch.tensor([prompt + out], device=device)
            logprobs = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
            chosen = logprobs.gather(1, torch.tensor(out, device=device)[:, None])[:, 0]
            gaps += (logprobs.max(dim=-1).values - chosen).tolist()
    del hf
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return gaps


class Server:
    """`pdserve serve` on the GPU, its output in a log; ready once it prints its HTTP address."""

    def __init__(self, model: Path, transport: str, work: Path) -> None:
        from pdserve.tune.local_server import free_port

        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        config = work / "pdserve.toml"
        config.write_text("".join(f"{k} = {v}\n" for k, v in ENGINE.items()))
        self.client_port = free_port()
        self.command = [sys.executable, "-m", "pdserve", "serve", "--model", str(model)]
        self.command += ["--device", "cuda", "--dtype", "bfloat16", "--transport", transport]
        self.command += ["--port", "0", "--client-port", str(self.client_port)]
        self.command += ["--config", str(config), "--log-dir", str(work), "--drain-timeout", "5"]
        self.url: str | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        """Seconds until it serves; raises with the end of its log if it does not."""
        started = time.monotonic()
        log = open(self.work / "serve.log", "w")  # noqa: SIM115 (closed by the reader thread)
        self.proc = subprocess.Popen(
            self.command, cwd=deps.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, args=(log,), daemon=True).start()
        deadline = started + timeout_s
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"not serving after {timeout_s:.0f} s") from None
            if line is None:
                raise RuntimeError(f"pdserve serve exited with {self.proc.wait()}: {self.tail()}")
            if line.startswith("pdserve: serving "):
                self.url = line.split()[-1]
        return time.monotonic() - started

    def _read(self, log) -> None:  # noqa: ANN001
        assert self.proc is not None and self.proc.stdout is not None
        with log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.lines.put(line.strip())
        self.lines.put(None)

    def tail(self, lines: int = 3) -> str:
        text = (self.work / "serve.log").read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, then stops its nodes
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its nodes get SIGTERM when it dies
                self.proc.wait()


async def stream_tokens(client_port: int, prompt_ids: list[list[int]]) -> list[dict]:
    """Each prompt alone through the coordinator's client socket: its streamed token ids."""
    from pdserve.coordinator.client import CoordinatorClient
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    results = []
    async with CoordinatorClient(f"tcp://127.0.0.1:{client_port}") as client:
        for prompt in prompt_ids:
            tokens, events, started = [], 0, time.perf_counter()
            async for event in client.generate(prompt, params):
                tokens.extend(event.token_ids)
                events += 1
            results.append(
                {"tokens": tokens, "events": events, "seconds": time.perf_counter() - started}
            )
    return results


def first_difference(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def load_run(url: str, vocab: int, out: Path, log: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pdserve.bench.serve_load", "--base-url", url, "--rate", "inf"]
    cmd += ["--max-concurrency", str(LOAD["max_concurrency"])]
    cmd += ["--num-requests", str(LOAD["num_requests"]), "--short-prompt-len", LOAD["prompt_len"]]
    cmd += ["--short-output-len", LOAD["output_len"], "--token-id-range", f"10:{vocab - 1}"]
    # logprobs: every token in a chunk of its own (as bench.compare asks); SLOs only for the form.
    cmd += ["--logprobs", "0", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--no-progress"]
    cmd += ["--output", str(out)]
    with open(log, "w") as f:
        subprocess.run(
            cmd, cwd=deps.REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, check=True
        )
    summary = json.loads(out.read_text())["summary"]
    return {
        "command": " ".join(cmd[1:]),
        "completed": summary["completed"],
        "failed": summary["failed"],
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "output_tokens_per_s": summary["output_token_throughput"],
        "requests_per_s": summary["request_throughput"],
        "duration_s": summary["duration_s"],
    }


def run_transport(
    record: StepRecord,
    transport: str,
    model: Path,
    prompt_ids,
    expected,
    vocab: int,
    work: Path,
    deadline: Deadline,
) -> None:
    result: dict = {}
    record.data.setdefault("transports", {})[transport] = result
    server = Server(model, transport, work / transport)
    try:
        result["start_s"] = server.start(min(180.0, deadline.left() - 20))
        record.save()
        streams = asyncio.run(stream_tokens(server.client_port, prompt_ids))
        result["streams"] = []
        for i, (got, want) in enumerate(zip(streams, expected)):
            diff = first_difference(got["tokens"], want)
            result["streams"].append(
                {
                    "prompt_len": len(prompt_ids[i]),
                    "events": got["events"],
                    "first_difference": diff,
                }
            )
            if diff is not None:
                record.fail(
                    f"serving/{transport}, prompt {i} ({len(prompt_ids[i])} tokens)",
                    f"stream differs from the offline engine at output token {diff}: "
                    f"{got['tokens'][diff : diff + 3]} vs {want[diff : diff + 3]}",
                )
        same = sum(s["first_difference"] is None for s in result["streams"])
        result["identical"] = f"{same}/{len(expected)}"
        record.save()
        if deadline.left() < 25:
            record.note(f"{transport}: no load run, the time box is spent")
            return
        load = load_run(
            server.url,
            vocab,
            work / f"load-{transport}.json",
            work / transport / "serve_load.log",
            deadline.left() - 15,
        )
        result["load"] = load
        if load["failed"]:
            record.fail(f"serving/{transport} load", f"{load['failed']} requests failed")
        record.figures[transport] = {
            "identical": result["identical"],
            "ttft_p50_ms": load["ttft_ms"]["p50"],
            "ttft_p99_ms": load["ttft_ms"]["p99"],
            "tpot_p50_ms": load["tpot_ms"]["p50"],
            "tpot_p99_ms": load["tpot_ms"]["p99"],
            "output_tokens_per_s": load["output_tokens_per_s"],
            "requests_per_s": load["requests_per_s"],
        }
    except Exception as exc:  # noqa: BLE001 (a failed start or run is the finding)
        record.fail(f"serving/{transport}", f"{type(exc).__name__}: {exc}")
        if server.proc is not None:
            result["serve_log_tail"] = server.tail(10)
    finally:
        server.stop()
        record.save()


def main(argv: list[str] | None = None) -> int:
    args = step_args(__doc__.split("\n\n")[0], argv)
    record = StepRecord(args.json)
    import torch

    if not torch.cuda.is_available():
        record.finish("no CUDA device", status="skipped")
        return 0
    work = Path(args.work)
    model = work / "llama-1b-random"
    started = time.monotonic()
    record.data["model"] = write_model(model) | {"shape": MODEL_SHAPE, "engine": ENGINE}
    record.data["model"]["write_s"] = time.monotonic() - started
    vocab = record.data["model"]["vocab_size"]
    prompt_ids = prompts(vocab)
    started = time.monotonic()
    expected = offline_reference(model, prompt_ids)
    record.data["offline_s"] = time.monotonic() - started
    # The bfloat16 outputs the streams must equal, against float32: not against themselves.
    gaps = float32_gaps(model, prompt_ids, expected)
    record.data["bf16_vs_float32"] = {
        "max_gap_nats": max(gaps),
        "mean_gap_nats": sum(gaps) / len(gaps),
        "tokens_float32_chose_too": sum(g == 0 for g in gaps),
        "tokens": len(gaps),
        "tolerance_nats": BF16_TOLERANCE_NATS,
    }
    if max(gaps) > BF16_TOLERANCE_NATS:
        record.fail(
            "bfloat16 vs float32",
            f"a greedy bfloat16 token sits {max(gaps):.3f} nats below float32's best "
            f"(tolerance {BF16_TOLERANCE_NATS})",
        )
    record.save()
    # Transports this host cannot serve over are not proven here (the report says so and why);
    # one the time box left no room for is not run, which fails the step: a skip is not a pass.
    not_proven = record.data.setdefault("not_proven", {})
    for transport in TRANSPORTS:
        if transport == "cuda_ipc" and importlib.util.find_spec("cupy") is None:
            not_proven[transport] = "CuPy is not importable"
            record.note("cuda_ipc not run: CuPy is not importable")
            continue
        if args.deadline.left() < 40:
            record.fail(transport, "not run: the time box is spent")
            continue
        run_transport(record, transport, model, prompt_ids, expected, vocab, work, args.deadline)
    shutil.rmtree(model, ignore_errors=True)  # 2 GB that the logs archive must not take
    parts = [
        f"{t}: {f['identical']} streams identical, TTFT p50 {f['ttft_p50_ms']:.0f} ms, "
        f"TPOT p50 {f['tpot_p50_ms']:.1f} ms, {f['output_tokens_per_s']:.0f} tok/s"
        for t, f in record.figures.items()
    ]
    record.finish("; ".join(parts) or "no transport ran")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
