"""The request-level engine the nodes drive: `add_request`, `step`, `abort`.

One step = schedule -> execute -> postprocess. `Engine` decides (requests, scheduler, block
manager, sequences) and hands each step to an `Executor`: `LLMEngine` runs the model and the
sampler on a device; the tuner's simulator (`tune/`) models the step's time instead.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import threads as cpu_threads
from pdserve.engine.cpu.thread_governor import CpuTimes, ThreadGovernor
from pdserve.engine.embedded.catalog import model_name, resolve_model_dir
from pdserve.engine.execution.executor import Executor, ModelExecutor, SampledTokens, StepStats
from pdserve.engine.grammar import Constraint, Grammars
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.kv.events import KVEvents
from pdserve.engine.kv.kv_manager import KVCacheManager
from pdserve.engine.kv.state_pages import fitted_block_size
from pdserve.engine.kv.tiers import KVTiers, TierStats, tiers_for
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.draft_model import (
    DraftModelProposer,
    draft_pool_share,
    load_draft_model,
)
from pdserve.engine.spec_decode.speculation import NgramProposer, Proposer
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.tp.executor import TPExecutor
from pdserve.engine.tp.model_shard import PoolFactory
from pdserve.engine.tp.ranks import RankProcesses, form_shard
from pdserve.engine.tp.shard import TPShard

# Forced tokens appended after one sampled token, at most (bounds a step's host time).
MAX_FORCED_TOKENS = 64

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request the engine refuses before it holds any resource."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # stop | length | abort
    logprobs: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # A prefill-only request's KV, left in these blocks (a table per KV group, -1 where no
    # later query reads): the engine no longer tracks them, and the caller frees them
    # (block_manager.free of `kv_manager.live_blocks`) once the handoff is over.
    held_tables: list[list[int]] | None = None
    # Why the request ended without output (its constraint could not be compiled): the node
    # reports it as the request's error.
    error: str | None = None


@dataclass(slots=True)
class EngineLoad:
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    prefix_hits: int
    prefix_misses: int
    forced_tokens: int = 0  # appended by constraints without a step (since start)
    spec_draft_tokens: int = 0  # speculative decoding's verified drafts (since start)
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # A draft model's prompt tokens: computed to catch its KV up, and taken from its prefix cache
    spec_draft_catch_up_tokens: int = 0
    spec_draft_cached_tokens: int = 0
    kv_tiers: TierStats | None = None  # the KV tiers under the pool, if any (since start)
    kv_tier_blocks: dict[str, int] = field(default_factory=dict)  # blocks each tier holds now
    prefill_tokens_computed: int = 0  # prompt tokens whose KV steps computed (since start)


class Engine:
    """Requests, scheduling and KV bookkeeping over an executor: everything a node decides."""

    def __init__(
        self,
        config: EngineConfig,
        layout: KVLayout,
        num_blocks: int,
        vocab_size: int,
        max_position_embeddings: int,
        eos_token_ids: tuple[int, ...],
        executor: Executor | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """proposer: speculative decoding's, where the config's method needs a model (a draft
        model's); the n-gram one is made here."""
        self.config = config
        self.layout = layout
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.executor = executor
        self.pool: KVPool | None = None  # the pages themselves, where an executor holds them
        self.tiers: KVTiers | None = None  # host and disk tiers under the pool, if any
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        # The longest sequence the pool holds: every token's block in each full group, a
        # window's or chunk's reach and one prefill chunk in each other group.
        pool_tokens = num_blocks * config.block_size
        chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else pool_tokens
        capacity = KVCacheManager(self.block_manager, layout.groups).longest_sequence(
            num_blocks, chunk, pool_tokens
        )
        self.max_model_len = min(config.max_model_len or max_position_embeddings, capacity)
        speculation = config.speculation()
        self.speculation = speculation
        if proposer is None and speculation is not None:
            if speculation.method != "ngram":
                raise ValueError(
                    f"speculative_config method {speculation.method!r} needs a model executor "
                    "(LLMEngine) to propose"
                )
            proposer = NgramProposer(speculation)
        self.proposer = proposer
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.scheduling_policy,
            proposer=proposer,
            num_speculative_tokens=speculation.num_speculative_tokens if speculation else 0,
            disable_speculation_above=speculation.disable_by_batch_size if speculation else None,
            max_model_len=self.max_model_len,
            kv_groups=layout.groups,
        )
        self.scheduler.kv.snapshot_interval = config.linear_snapshot_interval
        if config.max_model_len and config.max_model_len > capacity:
            logger.warning(
                "max_model_len %d exceeds the KV pool's %d tokens; using %d",
                config.max_model_len,
                capacity,
                capacity,
            )
        self.seqs: dict[str, Sequence] = {}
        self.stats = StepStats()
        # Structured outputs: the node's compiled grammars (None: this engine takes none), and
        # the sequences whose grammar is still compiling, with where each goes once it is ready
        # and when it stops waiting (time.monotonic()).
        self.grammars: Grammars | None = None
        self._compiling: list[tuple[Sequence, str, float]] = []
        # Called with each step's schedule before it executes (layer-wise KV streaming).
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None

    # --- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_offset: int = 0,
    ) -> Sequence:
        """Queue a request. A prefill_only one leaves the engine after its first token (unless
        that token ends it): its output carries the blocks holding its KV, now the caller's to
        free. output_offset: outputs of this request sampled before (on another node)."""
        seq = self.new_sequence(request_id, prompt_token_ids, params, output_offset=output_offset)
        seq.prefill_only = prefill_only
        self.seqs[request_id] = seq
        self._queue(seq, "waiting")
        return seq

    def _queue(self, seq: Sequence, where: str) -> None:
        """Into the scheduler's waiting queue or running batch, once its grammar is compiled
        (a request waits for its grammar here, never blocking a step)."""
        if seq.constraint is not None and not seq.constraint.ready:
            deadline = time.monotonic() + self.config.grammar_compile_timeout_s
            self._compiling.append((seq, where, deadline))
        elif where == "waiting":
            self.scheduler.add(seq)
        else:
            self.scheduler.add_running(seq)

    def _take_compiled(self) -> list[RequestOutput]:
        """Queue the sequences whose grammar is ready; end those whose grammar failed or did not
        compile by their deadline (the compile thread goes on; later compiles queue behind it)."""
        failed = []
        still = []
        now = time.monotonic()
        for seq, where, deadline in self._compiling:
            if not seq.constraint.ready and now >= deadline:
                seq.constraint.expire(self.config.grammar_compile_timeout_s)
                logger.warning("[%s] %s", seq.request_id, seq.constraint.error)
            if not seq.constraint.ready:
                still.append((seq, where, deadline))
            elif seq.constraint.error is not None:
                self.seqs.pop(seq.request_id, None)
                self.scheduler.kv.free(seq)  # an arrived sequence's blocks, if any
                failed.append(RequestOutput(seq.request_id, [], True, "abort",
                                            error=seq.constraint.error))  # fmt: skip
            else:
                self._queue(seq, where)
        self._compiling = still
        return failed

    def new_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_computed: int | None = None,
        output_offset: int = 0,
    ) -> Sequence:
        """A validated sequence, not yet scheduled. With num_computed, the first num_computed
        tokens are its prompt and already have KV (it arrives from another node) and the rest
        are outputs; `add_running` starts it once the KV is in."""
        prompt = token_ids if num_computed is None else token_ids[:num_computed]
        if request_id in self.seqs:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if not prompt:
            raise RequestRejected("the prompt is empty")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {len(prompt)} tokens; this model's context is "
                f"{self.max_model_len} tokens, leaving no room to generate"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(prompt) > budget:
            raise RequestRejected(
                f"prompt has {len(prompt)} tokens, over max_num_batched_tokens={budget} "
                "with chunked prefill disabled"
            )
        seq = Sequence(request_id, prompt, params, self.eos_token_ids, output_offset=output_offset)
        if params.structured is not None:
            if self.grammars is None:
                raise RequestRejected("this engine takes no structured outputs")
            seq.constraint = Constraint(params.structured, self.grammars.request(params.structured))
        if num_computed is not None:
            seq.token_ids = list(token_ids)
            seq.num_computed_tokens = num_computed
        return seq

    def add_running(self, seq: Sequence) -> None:
        """Join the running batch at the next step: a sequence whose blocks hold its KV."""
        if seq.request_id in self.seqs:
            raise RequestRejected(f"request id {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self._queue(seq, "running")

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        held = [entry for entry in self._compiling if entry[0] is seq]
        if held:
            self._compiling.remove(held[0])
            self.scheduler.kv.free(seq)
            return True
        self.scheduler.abort(request_id)
        return True

    @property
    def model_name(self) -> str:
        """What the model is called on the wire: an embedded model's name, or its directory's."""
        return model_name(self.config.model)

    def load(self) -> EngineLoad:
        """What a node reports to the coordinator about this engine."""
        sched = self.scheduler
        bm = self.block_manager
        queued = sum(s.num_uncomputed_tokens for s in sched.waiting) + sum(
            s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1
        )
        tiers = self.tiers
        return EngineLoad(
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            running=len(sched.running),
            waiting=len(sched.waiting) + len(sched.loading),
            queued_prefill_tokens=queued,
            prefix_hits=bm.prefix_hits,
            prefix_misses=bm.prefix_misses,
            forced_tokens=self.stats.num_forced_tokens,
            spec_draft_tokens=self.stats.num_draft_tokens,
            spec_accepted_tokens=self.stats.num_accepted_tokens,
            spec_accepted_per_position=list(self.stats.accepted_per_position),
            # A draft model's proposer counts these (n-gram lookup has no draft KV).
            spec_draft_catch_up_tokens=getattr(self.proposer, "num_catch_up_tokens", 0),
            spec_draft_cached_tokens=getattr(self.proposer, "num_cached_tokens", 0),
            kv_tiers=tiers.stats if tiers is not None else None,
            kv_tier_blocks=tiers.num_blocks() if tiers is not None else {},
            prefill_tokens_computed=sched.num_prefill_tokens_computed,
        )

    def enable_kv_events(self) -> KVEvents:
        """Log blocks entering and leaving this engine's KV tiers from now on (a node drains the
        log into each load report; nothing does offline, so it is off until asked for)."""
        if self.block_manager.events is None:
            self.block_manager.events = KVEvents()
            if self.tiers is not None:
                self.tiers.set_events(self.block_manager.events)
        return self.block_manager.events

    def check_alive(self) -> None:
        """Raise if the engine can no longer run steps (a rank of its group died); nodes call it
        with every load report, so an idle node notices too."""

    def watch_failure(self, on_failure: Callable[[str], None]) -> None:
        """From now on, call on_failure(why) from a thread of its own the moment the engine can
        no longer run steps (a rank of its group died), rather than at its next step; an engine
        of one process never does."""

    def has_unfinished(self) -> bool:
        """Work left for steps: requests, grammars compiling, or copies to or from the KV tiers
        that a step collects."""
        return (
            self.scheduler.num_unfinished > 0
            or bool(self._compiling)
            or (self.tiers is not None and self.tiers.busy)
        )

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        failed = self._take_compiled() if self._compiling else []
        if self.tiers is not None:
            self._collect_tiers()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self._compiling and not failed:  # nothing to run but a grammar being compiled
                wait([s.constraint.future for s, _, _ in self._compiling], timeout=0.002)
            elif self.tiers is not None and self.tiers.busy:  # nothing but copies in flight
                self.tiers.wait(0.002)
            return failed
        if self.on_schedule is not None:
            self.on_schedule(out)
        outputs = failed + self._postprocess(out, self.executor.execute(out))
        if self.tiers is not None:
            self.tiers.store_new()  # the blocks this step filled, down to the host tier
        self.stats.num_steps += 1
        self.stats.num_tokens += out.num_tokens
        self.stats.total_s += time.perf_counter() - t0
        return outputs

    def _collect_tiers(self) -> None:
        """Take in what the KV tiers finished: loaded prefixes back to the queue (their blocks
        in the prefix cache), and blocks registered between steps (arrived KV) sent down."""
        self.tiers.poll()
        self.tiers.store_new()

    def _postprocess(self, out: SchedulerOutput, sampled: SampledTokens) -> list[RequestOutput]:
        appended = self.scheduler.postprocess(
            out, dict(zip(sampled.rows, sampled.token_ids)), self.max_model_len, sampled.more_tokens
        )
        if sampled.num_drafts:
            self.stats.count_speculation(sampled)
        outputs = []
        for index, lp in zip(sampled.rows, sampled.logprobs):
            seq = out.scheduled[index].seq
            if lp is not None:
                seq.output_logprobs.append(lp)
            num_forced = self._append_forced(seq) if self.config.forced_tokens else 0
            prefilled = seq.status is SequenceStatus.PREFILLED
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    seq.token_ids[-appended[index] - num_forced :],
                    seq.is_finished or prefilled,
                    seq.finish_reason,
                    [lp] if lp is not None else [],
                    seq.num_prompt_tokens,
                    seq.num_cached_tokens,
                    [list(t) for t in seq.block_tables] if prefilled else None,
                )
            )
            if seq.is_finished or prefilled:
                self.seqs.pop(seq.request_id, None)
        return outputs

    def _append_forced(self, seq: Sequence) -> int:
        """Tokens the sequence's grammar forces after its sampled one, appended (how many)."""
        if (
            seq.constraint is None
            or seq.status is not SequenceStatus.RUNNING
            or seq.params.logprobs is not None
        ):
            return 0
        num_forced = 0
        while num_forced < MAX_FORCED_TOKENS and seq.status is SequenceStatus.RUNNING:
            token = seq.constraint.forced_token(self.vocab_size)
            if token is None:
                break
            self.scheduler.append_forced(seq, token, self.max_model_len)
            num_forced += 1
        self.stats.num_forced_tokens += num_forced
        return num_forced


class LLMEngine(Engine):
    """The engine of a node: a checkpoint's model and tokenizer, a KV pool on its device; with
    tensor_parallel_size N, rank 0 of N ranks (the others in processes it starts)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        pool_factory: PoolFactory | None = None,
        kv_endpoints: list[Any] | None = None,
        **overrides: object,
    ) -> None:
        """pool_factory(layout, num_blocks) makes rank 0's KV pool, e.g. in shared memory for a
        transport that writes into it; by default a plain tensor on the device. kv_endpoints:
        how ranks 1..N-1 make theirs (`pdserve.kv_transfer.rank_endpoint`)."""
        config = config or EngineConfig(**overrides)
        self.model_dir = resolve_model_dir(config.model)
        torch.manual_seed(config.seed)
        self.config = config
        self.tokenizer = Tokenizer(self.model_dir)
        mcfg = ModelConfig.from_pretrained(self.model_dir)
        shard = TPShard(0, config.tensor_parallel_size)
        shard.check(mcfg)
        config = self.config = _fit_to_model(config, mcfg)
        speculation = config.speculation()
        draft_model = None
        if speculation is not None and speculation.method == "draft_model":
            # Before the target's pool is sized: the draft's weights take device memory first.
            draft_model = load_draft_model(speculation, config, self.model_dir)
        # What the draft's pool takes of the target's KV budget.
        draft_share = draft_pool_share(draft_model, config, speculation) if draft_model else (0, 0)
        self.ranks = None
        self._placement_before: cpu_threads.CpuPlacement | None = None
        self._governor: ThreadGovernor | None = None  # adaptive intra-op threads (CPU)
        self._cpu_times: CpuTimes | None = None
        on_cpu = not config.rank_device(0).startswith("cuda")
        if on_cpu and config.cpu_bind == cpu_threads.AUTO:
            # The ranks split the cores this process may use now, before rank 0 binds itself.
            cores = cpu_threads.format_cores(cpu_threads.available_cores())
            config = self.config = replace(config, cpu_bind=cores)
        if shard.size > 1:
            self.ranks = RankProcesses(
                self.model_dir, config, mcfg.max_position_embeddings, kv_endpoints
            )
        if on_cpu:
            self._place_on_cpu(config, shard.size)
        try:
            self.shard = form_shard(
                self.model_dir, config, shard, self.ranks, pool_factory, draft_share
            )
        except BaseException:
            self._restore_cpu_placement()  # this process's threads as they were
            raise
        self.device = self.shard.device
        self.model = self.shard.model
        self.ops = self.shard.ops
        self.runner = self.shard.runner
        layout = KVLayout.for_model(mcfg, config.block_size, config.kv_dtype())
        eos = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + mcfg.eos_token_ids))
        proposer = None
        if draft_model is not None:
            num_draft_blocks = speculation.draft_num_kv_blocks or self.shard.num_blocks
            proposer = DraftModelProposer(draft_model, num_draft_blocks, config, speculation)
        super().__init__(
            config,
            layout,
            self.shard.num_blocks,
            mcfg.vocab_size,
            mcfg.max_position_embeddings,
            eos,
            proposer=proposer,
        )
        self.pool = self.shard.pool
        self.tiers = self.scheduler.tiers = tiers_for(config, self.pool, self.block_manager)
        self.grammars = Grammars(self.model_dir, mcfg.vocab_size, eos)
        self.shard.capture_decode_graphs()
        graphs = self.runner.decode_graphs
        if self.speculation is not None and graphs is not None:
            if isinstance(proposer, DraftModelProposer):
                proposer.capture_graphs(
                    graphs.max_batch_size,
                    self.shard.context_limit,
                    speculation.num_speculative_tokens,
                )
            logger.info(
                "speculative decoding: verification steps of up to %d tokens replay CUDA graphs "
                "as decode rows",
                graphs.sizes[-1],
            )
        if self.ranks is None:
            self.executor = ModelExecutor(self.runner, self.stats)
        else:
            self.executor = TPExecutor(self.runner, self.stats, self.ranks)
            weakref.finalize(self, self.ranks.stop)

    def _place_on_cpu(self, config: EngineConfig, size: int) -> None:
        """The ranks of a CPU node share its cores (idle OpenMP threads spin): rank 0 takes its
        share (`cpu_threads.place_rank`); alone, with adaptive threads, a governor lowers them
        while other processes hold its cores."""
        place, self._placement_before = cpu_threads.place_rank(
            config.cpu_bind, config.cpu_threads, 0, size
        )
        logger.info("cpu: %s", place.describe())
        if config.cpu_adaptive_threads and size == 1 and place.threads > 1:
            self._governor = ThreadGovernor(place.threads, time.monotonic())
            self._cpu_times = CpuTimes(place.cores or cpu_threads.available_cores())

    def _restore_cpu_placement(self) -> None:
        """This process's cores and threads as they were before `_place_on_cpu`."""
        if self._placement_before is not None:
            cpu_threads.apply(self._placement_before)
            self._placement_before = None

    def check_alive(self) -> None:
        if self.ranks is not None:
            self.ranks.check()

    def watch_failure(self, on_failure: Callable[[str], None]) -> None:
        if self.ranks is not None:
            self.ranks.watch(on_failure)

    def step(self) -> list[RequestOutput]:
        if self._governor is None:
            return super().step()
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = super().step()
        self._cpu_times.add_step(time.perf_counter() - wall, time.process_time() - cpu)
        window = self._cpu_times.window()
        if window is not None:
            threads = self._governor.decide(window, time.monotonic())
            if threads != torch.get_num_threads():
                logger.info(
                    "cpu: %d intra-op thread%s (threads ran %.0f%% of a core each; %.1f idle "
                    "cores)",
                    threads,
                    "s" * (threads != 1),
                    100 * window.cpu_s / (window.step_s * torch.get_num_threads()),
                    window.idle_cores,
                )
                torch.set_num_threads(threads)
            self._cpu_times.reset()
        return outputs

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit)."""
        self.executor.close()
        self.grammars.close()
        if self.tiers is not None:
            self.tiers.close()
        self._restore_cpu_placement()


def _fit_to_model(config: EngineConfig, mcfg: ModelConfig) -> EngineConfig:
    """The config a node of this model runs: a hybrid model's pages must hold a linear layer's
    state (`fitted_block_size`), and its states cannot step back over rejected drafts."""
    if mcfg.linear_attention is None:
        return config
    if config.speculation() is not None:
        raise ValueError(
            f"speculative decoding is not supported for {mcfg.model_type}: its linear-attention "
            "layers' states cannot be rolled back over rejected drafts"
        )
    block_size = fitted_block_size(mcfg, config.block_size)
    if block_size != config.block_size:
        logger.info(
            "block_size %d -> %d: a block's page holds a linear-attention layer's state "
            "(its conv window and recurrent matrices)",
            config.block_size,
            block_size,
        )
        config = replace(config, block_size=block_size)
    return config
