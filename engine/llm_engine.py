"""The request-level engine the nodes drive: `add_request`, `step`, `abort`.

One step = schedule -> run -> sample -> postprocess, over a paged KV pool on one device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
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
    def __init__(
        self,
        config: EngineConfig | None = None,
        pool_factory: Callable[[KVLayout, int], KVPool] | None = None,
        **overrides: object,
    ) -> None:
        """pool_factory(layout, num_blocks) makes the KV pool, e.g. in shared memory for a
        transport that writes into it; by default a plain tensor on the device."""
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
        if pool_factory is None:
            self.pool = KVPool(self.layout, num_blocks, device)
        else:
            self.pool = pool_factory(self.layout, num_blocks)
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
        if self._use_cuda_graphs():
            self.runner.capture_decode_graphs(
                min(config.cuda_graph_max_batch_size, config.max_num_seqs), self.max_model_len
            )
        self.eos_token_ids = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + mcfg.eos_token_ids))
        self.seqs: dict[str, Sequence] = {}
        self.stats = StepStats()

    def _use_cuda_graphs(self) -> bool:
        """Graphs need CUDA and kernels free of host syncs: the Triton ones, not the reference
        (which reads sequence lengths on the host to group its gathers)."""
        if self.config.enforce_eager or not self.device.startswith("cuda"):
            return False
        if self.ops.name != "triton":
            logger.info("decode steps run eagerly: CUDA graphs need the triton kernel backend")
            return False
        return True

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
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        generator_offset: int = 0,
    ) -> Sequence:
        """Queue a request. With prefill_only, it finishes after its first token with reason
        "prefilled" (unless it truly stopped) and keeps its blocks until `release`.
        generator_offset: random draws this request already used on other nodes."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only)
        seq.skip_draws(generator_offset, self.model.config.vocab_size)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
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
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(prompt_token_ids) > budget:
            raise RequestRejected(
                f"prompt has {len(prompt_token_ids)} tokens, over max_num_batched_tokens={budget} "
                "with chunked prefill disabled"
            )
        return Sequence(request_id, prompt_token_ids, params, self.eos_token_ids, prefill_only)

    def release(self, request_id: str) -> None:
        """Free the blocks a prefilled sequence kept for its handoff."""
        seq = self.seqs.pop(request_id)
        self.block_manager.free(seq.block_table)

    # --- KV handoff, receiving side ------------------------------------------------------------

    def reserve_transfer(
        self,
        request_id: str,
        token_ids: list[int],
        num_computed: int,
        params: SamplingParams,
        generator_offset: int = 0,
    ) -> Sequence | None:
        """Allocate blocks for a sequence whose first num_computed tokens' KV will arrive from
        another node. Returns None (nothing held) when the pool has no room."""
        seq = self._new_sequence(request_id, token_ids[:num_computed], params)
        seq.token_ids = list(token_ids)
        if self.block_manager.allocate_slots(seq.block_table, num_computed) is None:
            return None
        seq.num_computed_tokens = num_computed
        seq.skip_draws(generator_offset, self.model.config.vocab_size)
        self.seqs[request_id] = seq
        return seq

    def start_transferred(self, seq: Sequence) -> None:
        """Its KV has fully arrived: it joins the running batch at the next step."""
        self.scheduler.add_running(seq)

    def drop_transfer(self, seq: Sequence) -> None:
        """A handoff that failed or was aborted: free its blocks."""
        self.seqs.pop(seq.request_id, None)
        self.block_manager.free(seq.block_table)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.finish_reason == "prefilled":
            self.block_manager.free(seq.block_table)
        else:
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
            if seq.is_finished and seq.finish_reason != "prefilled":
                self.seqs.pop(seq.request_id, None)
        return outputs
