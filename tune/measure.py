"""`pdserve tune profile`: the step-time model measured on this machine, from a grid of real engine
steps (scheduler, `ModelRunner`, sampler, postprocess: what a node's loop runs each step), and the
transfer model from the transfer probe's transfers, both fitted and saved as a profile."""

from __future__ import annotations

import itertools
import logging
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.cache import KVLayout
from pdserve.engine.llm_engine import LLMEngine
from pdserve.tune.model_shape import ModelShape
from pdserve.tune.profile import Profile
from pdserve.tune.step_model import StepShape, fit
from pdserve.tune.transfer_model import TransferModel
from pdserve.tune.transfer_probe import TransferProbe

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepGrid:
    """The steps timed: decodes of `batch` sequences at `context` tokens; prefill chunks of
    `length` tokens (`prompts` of them) after `context` computed tokens; and mixed steps of
    decodes with one chunk."""

    decode_batches: tuple[int, ...] = (1, 4, 16, 64, 128)
    decode_contexts: tuple[int, ...] = (64, 512, 2048)
    chunk_lengths: tuple[int, ...] = (16, 64, 256, 1024, 2048)
    chunk_contexts: tuple[int, ...] = (0, 1024)
    chunk_prompts: tuple[int, ...] = (1, 4)
    mixed: tuple[tuple[int, int], ...] = ((16, 256), (64, 1024))  # (decodes, chunk length)
    repeats: int = 5

    @classmethod
    def quick(cls) -> StepGrid:
        """A few points, for checking the command itself."""
        return cls((1, 8), (32, 128), (16, 128), (0, 64), (1,), ((4, 32),), 2)

    def points(self, max_tokens: int) -> list[tuple[list[tuple[int, int, int]], str]]:
        """Each step as (count, context, new tokens) groups, with a label; steps over the
        model's context are left out."""
        out = []
        for batch, context in itertools.product(self.decode_batches, self.decode_contexts):
            if context + 1 < max_tokens:
                out.append(([(batch, context, 1)], f"decode {batch} x {context}"))
        for length, context, prompts in itertools.product(
            self.chunk_lengths, self.chunk_contexts, self.chunk_prompts
        ):
            if context + length < max_tokens and (prompts == 1 or length <= 256):
                out.append(
                    ([(prompts, context, length)], f"chunk {prompts} x {length} @ {context}")
                )
        for decodes, length in self.mixed:
            if 512 + length < max_tokens:
                groups = [(decodes, 512, 1), (1, 0, length)]
                out.append((groups, f"{decodes} decodes + chunk {length}"))
        return out


def step_engine(
    model_dir: str | None, device: str, dtype: str, grid: StepGrid, threads: int | None = None
) -> LLMEngine:
    """An engine with room for the grid's largest step, and no prefix caching (every timed
    sequence computes all it is given). On a CPU it runs `threads` math threads (unset: the
    engine's default, one per core) and keeps them: the thread governor, which would change them
    with the machine's load between the grid's steps, is off."""
    cpu = {}
    if device == "cpu":
        cpu = {"cpu_threads": threads, "cpu_adaptive_threads": False}
    largest = max(
        sum(count * (-(-(context + new + 1) // 16)) for count, context, new in groups)
        for groups, _ in grid.points(1 << 30)
    )
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            device=device,
            dtype=dtype,
            num_kv_blocks=largest + 64,
            max_num_seqs=max(max(grid.decode_batches), max(d for d, _ in grid.mixed) + 1, 8),
            max_num_batched_tokens=1 << 20,
            enable_prefix_caching=False,
            **cpu,
        )
    )


WARM_UP_STEPS = 3


def time_step(engine: LLMEngine, groups: list[tuple[int, int, int]], repeats: int) -> float:
    """Median seconds of `engine.step()` over sequences that hold `context` computed tokens and
    have `new` more to compute, as a node's loop runs it; the first repeat warms up."""
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    ids = itertools.count()
    times = []
    for _ in range(repeats + 1):
        seqs = []
        for count, context, new in groups:
            for _ in range(count):
                tokens = [10 + (7 * i) % (engine.vocab_size - 10) for i in range(context + new)]
                # A fresh prompt (context 0) joins the running batch with no blocks yet.
                seq = engine.new_sequence(
                    f"p{next(ids)}", tokens, params, num_computed=context or None
                )
                if not engine.block_manager.allocate_slots(seq.block_table, context, 0):
                    raise RuntimeError("the profile's KV pool is too small")
                engine.add_running(seq)
                seqs.append(seq)
        if device_is_cuda(engine):
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if device_is_cuda(engine):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for seq in seqs:
            engine.abort(seq.request_id)
    return statistics.median(times[1:] or times)


def device_is_cuda(engine: LLMEngine) -> bool:
    return engine.device.startswith("cuda")


def measure_steps(
    engine: LLMEngine, grid: StepGrid, progress: Callable[[str], None] = lambda _: None
) -> tuple[list[StepShape], list[float], list[str]]:
    shapes, seconds, labels = [], [], []
    points = grid.points(engine.max_model_len)
    # An engine's first steps pay one-time costs (thread pools, kernels' first calls: a first
    # decode step of 1 x 32 measured 50-60 ms on CPU, then 1 ms); they belong to no shape.
    for groups, _ in points[:1] * WARM_UP_STEPS:
        time_step(engine, groups, 0)
    for groups, label in points:
        shape = sum(
            (
                StepShape.prefill(c, n, ctx) if n > 1 else StepShape.decode(c, ctx)
                for c, ctx, n in groups
            ),
            StepShape(0, 0, 0, 0, 0),
        )
        seconds.append(time_step(engine, groups, grid.repeats))
        shapes.append(shape)
        labels.append(label)
        progress(f"{label}: {seconds[-1] * 1e3:.2f} ms")
    return shapes, seconds, labels


def measure_transfer(
    transport: str,
    layout: KVLayout,
    blocks: tuple[int, ...] = (1, 8, 32, 128),
    repeats: int = 5,
) -> TransferModel:
    """The transfer probe's transfers of the model's own KV layout (a receiver in another process,
    blocks scattered over its pool as a busy node's are) at a few sizes, fitted to
    latency + bytes / bandwidth; a transfer's cost per page shows in the bandwidth."""
    pool_blocks = 2 * max(blocks) + 1
    probe = TransferProbe(transport, layout, pool_blocks, "cpu", chunk_bytes=8 << 20)
    rng = random.Random(0)
    try:
        sizes, seconds = [], []
        for n in blocks:
            src, dst = rng.sample(range(pool_blocks), n), rng.sample(range(pool_blocks), n)
            probe.run(src, dst)  # warm-up: first touch of pages, the connection
            times = [probe.run(src, dst) for _ in range(repeats)]
            sizes.append(n * layout.bytes_per_block)
            seconds.append(statistics.median(times))
    finally:
        probe.close()
    return TransferModel.fit(sizes, seconds, transport)


def measure_profile(
    model_dir: str | None,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    threads: int | None = None,
    grid: StepGrid | None = None,
    kv_blocks: int | None = None,
    block_size: int = 16,
    transfer: TransferModel | None = None,
    transport: str = "tcp",
    progress: Callable[[str], None] = lambda _: None,
) -> Profile:
    """Measure this machine. `kv_blocks`: a node's pool (default: the engine's own sizing with
    default settings); `transfer`: stated instead of measured."""
    if threads:
        torch.set_num_threads(threads)
    grid = grid or StepGrid()
    dtype = dtype or EngineConfig(device=device).resolved_dtype()
    engine = step_engine(model_dir, device, dtype, grid, threads)
    shape = ModelShape.from_config(engine.model.config, engine.model_dir.name)
    shapes, seconds, labels = measure_steps(engine, grid, progress)
    step = fit(shapes, seconds)
    if transfer is None:
        progress(f"KV transfer ({transport})")
        transfer = measure_transfer(transport, engine.layout)
    if kv_blocks is None:
        sized = EngineConfig(model=model_dir, device=device, dtype=dtype, block_size=block_size)
        kv_blocks = pool_blocks(sized, shape)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name()
    return Profile(
        model=shape,
        dtype=dtype,
        step=step,
        transfer=transfer,
        kv_blocks=kv_blocks,
        block_size=block_size,
        source=(
            f"measured: {len(shapes)} engine steps on {name} ({device}, {dtype}, "
            f"{torch.get_num_threads()} torch threads), transfers over {transfer.transport}"
        ),
        device=name,
        kv_blocks_setting=not device.startswith("cuda"),
        fit=[
            {"step": label, "measured_ms": s * 1e3, "model_ms": step.time(x) * 1e3}
            for label, x, s in zip(labels, shapes, seconds)
        ],
    )


def pool_blocks(config: EngineConfig, shape: ModelShape) -> int:
    """The blocks a node's pool gets under `config`: its num_kv_blocks, or its byte budget."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = shape.kv_bytes_per_block(config.block_size, config.kv_dtype())
    if config.resolved_device().startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return int(free * config.gpu_memory_utilization) // per_block
    from pdserve.engine.tp.model_shard import DEFAULT_CPU_KV_BYTES

    return (config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES) // per_block


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def measure_frontend(profile: Profile, model_dir: str | None, num_requests: int = 12) -> Profile:
    """What serving over HTTP adds on this machine: lone short requests to a real `pdserve serve`
    (one colocated worker), against the same requests simulated without it. Their median TPOT
    gives each step's time beyond the modeled one (`step_overhead_s`: the node's loop, the
    coordinator and the front end passing each token on); then, with it, their median TTFT what
    the front end adds to the first token (`frontend_s`)."""
    import asyncio
    import math
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from pdserve.tune.deployment import Deployment
    from pdserve.tune.load_generator import LoadConfig, run_load
    from pdserve.tune.local_server import PdserveServer, PdserveSystem
    from pdserve.tune.serving_workload import SyntheticWorkload
    from pdserve.tune.simulator import Simulation
    from pdserve.tune.slo import SLO
    from pdserve.tune.workload import SimRequest

    specs = SyntheticWorkload(short_prompt_len=(16, 16), short_output_len=(32, 32)).sample(
        num_requests + 2, seed=7
    )
    config = {"num_kv_blocks": profile.kv_blocks} if profile.kv_blocks_setting else {}
    system = PdserveSystem("frontend", decode_nodes=1, colocated=True, config=config)
    with tempfile.TemporaryDirectory() as work, PdserveServer(system, Path(work), model_dir) as s:
        cfg = LoadConfig(
            s.base_url, rate=math.inf, max_concurrency=1, progress=False, extra_body={"logprobs": 0}
        )
        run = asyncio.run(run_load(specs[2:], cfg, SLO(1.0, 1.0), specs[:2]))
    served = [r for r in run["requests"] if r["success"]]
    lone = [
        SimRequest(i * 0.5, s.prompt_len, s.output_len, tuple(s.prompt))
        for i, s in enumerate(specs[2:])
    ]

    def simulated(p: Profile) -> list:
        return Simulation(Deployment(0, 1, colocated=True), p).run(lone).outcomes

    bare = replace(profile, frontend_s=0.0, step_overhead_s=0.0)
    step_overhead = max(
        0.0,
        statistics.median(r["tpot"] for r in served)
        - statistics.median(o.tpot_s for o in simulated(bare)),
    )
    stepped = replace(bare, step_overhead_s=step_overhead)
    frontend = max(
        0.0,
        statistics.median(r["ttft"] for r in served)
        - statistics.median(o.ttft_s for o in simulated(stepped)),
    )
    return replace(
        stepped,
        frontend_s=frontend,
        source=f"{profile.source}; HTTP front end {frontend * 1e3:.1f} ms of TTFT and "
        f"{step_overhead * 1e3:.2f} ms a step beyond the engine's, measured",
    )
