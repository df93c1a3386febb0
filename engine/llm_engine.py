"""The request-level engine the nodes drive: `add_request`, `step`, `abort`.

One step = schedule -> run -> sample -> postprocess, over a paged KV pool on one device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_cache import KVLayout, KVPool
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.tiny_model import resolve_model_dir
from engine.tokenizer import Tokenizer
from kernels.ops import select_ops

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


class RequestRejected(ValueError):
    """A request the engine refuses before it holds any resource."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class StepStats:
    num_steps: int = 0
    num_tokens: int = 0
    forward_s: float = 0.0
    total_s: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: object) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        device = config.resolved_device()
        dtype = config.resolved_dtype()
        torch.manual_seed(config.seed)
        self.device = device
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = load_model(self.model_dir, dtype, device)
        mcfg = self.model.config
        self.layout = KVLayout(
            mcfg.num_layers, config.block_size, mcfg.num_kv_heads, mcfg.head_dim, dtype
        )
        num_blocks = config.num_kv_blocks or self._num_blocks_from_budget(device)
        self.pool = KVPool(self.layout, num_blocks, device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.scheduling_policy,
        )
        self.ops = select_ops(device, config.kernel_backend)
        self.runner = ModelRunner(self.model, self.pool, self.ops, device)
        capacity = num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, capacity)
        if config.max_model_len and config.max_model_len > capacity:
            logger.warning(
                "max_model_len %d exceeds the KV pool's %d tokens; using %d",
                config.max_model_len,
                capacity,
                capacity,
            )
        self.eos_token_ids = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + mcfg.eos_token_ids))
        self.seqs: dict[str, Sequence] = {}
        self.stats = StepStats()

    def _num_blocks_from_budget(self, device: str) -> int:
        if device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES
        num_blocks = KVPool.num_blocks_for_budget(self.layout, budget)
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {self.layout}")
        return num_blocks

    # --- requests ----------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        if request_id in self.seqs:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, leaving no room to generate"
            )
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_ids)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        t1 = time.perf_counter()
        logits, sample_rows = self.runner.run(out)
        t2 = time.perf_counter()
        outputs = self._sample_and_update(out, logits, sample_rows)
        t3 = time.perf_counter()
        self.stats.num_steps += 1
        self.stats.num_tokens += out.num_tokens
        self.stats.forward_s += t2 - t1
        self.stats.total_s += t3 - t0
        return outputs

    def _sample_and_update(
        self, out: SchedulerOutput, logits: torch.Tensor, sample_rows: list[int]
    ) -> list[RequestOutput]:
        seqs = [out.scheduled[i].seq for i in sample_rows]
        result = sample(logits, seqs) if seqs else None
        sampled = dict(zip(sample_rows, result.token_ids)) if result else {}
        logprobs = dict(zip(sample_rows, result.logprobs)) if result else {}
        self.scheduler.postprocess(out, sampled, self.max_model_len)
        outputs = []
        for index in sample_rows:
            seq = out.scheduled[index].seq
            lp = logprobs.get(index)
            if lp is not None:
                seq.output_logprobs.append(lp)
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    [seq.token_ids[-1]],
                    seq.is_finished,
                    seq.finish_reason,
                    [lp] if lp is not None else [],
                    seq.num_prompt_tokens,
                    seq.num_cached_tokens,
                )
            )
            if seq.is_finished:
                self.seqs.pop(seq.request_id, None)
        return outputs
