"""Execution of one scheduled step: turns its plan (token ids, positions, slots, block tables)
into tensors, runs the model over the paged pool and returns the logits of each sampling
sequence's last position (and of a speculating sequence's drafts)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from pdserve.engine.execution.compiled_step import CompiledStep
from pdserve.engine.execution.decode_graphs import DecodeGraphs
from pdserve.engine.execution.decode_rows import as_decode_rows, graph_row_sizes
from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.step_plan import StepPlan
from pdserve.kernels.op_table import Ops


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, ops: Ops, device: str) -> None:
        self.model = model
        self.pool = pool
        self.ops = ops
        self.device = torch.device(device)
        self.block_size = pool.layout.block_size
        self.decode_graphs: DecodeGraphs | None = None
        self.compiled: CompiledStep | None = None  # set once its warm-up compiled
        # Called with each layer's index once its K/V is in the pool (on a GPU: its kernels
        # queued), in eager steps that are not decode-only: layer-wise KV streaming, on every
        # tensor-parallel rank (a compiled step or a CUDA graph calls none).
        self.layer_hooks: list[Callable[[int], None]] = []
        # Steps run since start, on every rank alike (they run the same plans in order): what
        # ties a layer of one rank's step to the same layer of another's.
        self.step_index = -1
        self._in_layer: tuple[int, int] | None = None  # (step, layer) while the hooks run
        self._thread: int | None = None  # the thread running the forward

    def add_layer_hook(self, hook: Callable[[int], None]) -> None:
        """hook(layer) after each layer's K/V is in the pool (see `layer_hooks`)."""
        self.layer_hooks.append(hook)

    def layer_in_progress(self) -> tuple[int, int] | None:
        """(step, layer) when called from a layer hook of the step running now, else None."""
        if self._in_layer is None or threading.get_ident() != self._thread:
            return None
        return self._in_layer

    def _layer_done(self, layer: int) -> None:
        self._in_layer = (self.step_index, layer)
        try:
            for hook in self.layer_hooks:
                hook(layer)
        finally:
            self._in_layer = None

    def build_decode_graphs(
        self,
        max_batch_size: int,
        max_model_len: int,
        max_query_len: int = 1,
        max_rows: int | None = None,
    ) -> DecodeGraphs:
        """The graphs `capture_decode_graphs` captures, not yet captured (off CUDA they run
        their padded rows eagerly)."""
        return DecodeGraphs(
            self.model,
            self.pool,
            self.ops,
            self.device,
            max_batch_size,
            -(-max_model_len // self.block_size),
            graph_row_sizes(max_batch_size, max_query_len, max_rows),
            max_query_len,
        )

    def capture_decode_graphs(
        self,
        max_batch_size: int,
        max_model_len: int,
        max_query_len: int = 1,
        max_rows: int | None = None,
    ) -> None:
        """Replay decode-only steps of up to max_batch_size sequences from CUDA graphs (on every
        tensor-parallel rank alike: the collectives are captured with the rest), and with
        max_query_len > 1 steps whose chunks are at most that long (verification, forced tokens)
        as decode rows, up to max_rows tokens (`pdserve.engine.execution.decode_rows`)."""
        graphs = self.build_decode_graphs(max_batch_size, max_model_len, max_query_len, max_rows)
        graphs.capture()
        self.decode_graphs = graphs

    @property
    def runs_compiled(self) -> bool:
        """Whether model steps run compiled: a compiled step warmed up and no shape of it has
        failed to compile since (each failure is a warning in the log)."""
        return self.compiled is not None and self.compiled.runs_compiled

    def prepare(self, out: SchedulerOutput) -> StepPlan:
        return StepPlan.from_scheduled(out, self.block_size)

    def _to_device(self, batch: AttentionBatch) -> AttentionBatch:
        return AttentionBatch(
            slot_mapping=batch.slot_mapping.to(self.device),
            block_tables=batch.block_tables.to(self.device),
            seq_lens=batch.seq_lens.to(self.device),
            query_start_loc=batch.query_start_loc.to(self.device),
            max_query_len=batch.max_query_len,
            group_slot_mappings=tuple(s.to(self.device) for s in batch.group_slot_mappings),
            group_block_tables=tuple(t.to(self.device) for t in batch.group_block_tables),
        )

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [num_sampling, vocab] float32 on the model's device, indices of
        sampling sequences): the sampler runs where the logits are, so only token ids come back."""
        return self.run_plan(self.prepare(out))

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[int]]:
        """`run` for a plan; under tensor parallelism the logits are rank 0's alone (None on
        the other ranks, which take part in computing them)."""
        self.step_index += 1
        self._thread = threading.get_ident()
        ids, pos, batch = plan.inputs()
        sample_rows = plan.sample_rows
        graphs = self.decode_graphs
        if graphs is not None and plan.is_decode_only and graphs.fits(plan.num_seqs, plan.width):
            hidden = graphs.run(ids, pos, batch)  # copies the host inputs into its buffers
        elif (
            graphs is not None
            and not self.layer_hooks
            and graphs.fits_rows(plan.max_query_len, ids.shape[0], plan.width)
        ):
            # Verification or forced tokens: every token a decode row (same row order).
            hidden = graphs.run(ids, pos, as_decode_rows(batch))
            graphs.row_steps += 1
        elif self.compiled is not None:
            hidden = self.compiled(ids.to(self.device), pos.to(self.device), self._to_device(batch))
        else:
            ids, pos = ids.to(self.device), pos.to(self.device)
            hidden = self.model(
                ids,
                pos,
                self._to_device(batch),
                self.pool,
                self.ops,
                on_layer=self._layer_done if self.layer_hooks else None,
            )
        if not sample_rows:
            return torch.empty(0, device=self.device), sample_rows
        if plan.num_logit_rows == hidden.shape[0]:  # every token is scored: all decodes, say
            logits = self.model.compute_logits(hidden)
        elif not plan.sample_counts:
            last = batch.query_start_loc[1:] - 1
            rows = last[torch.tensor(sample_rows)].to(self.device)
            logits = self.model.compute_logits(hidden[rows])
        else:  # speculating sequences score their last 1 + drafts positions
            ends = plan.query_start[1:]
            rows = [
                p
                for index, count in zip(sample_rows, plan.sample_counts)
                for p in range(ends[index] - count, ends[index])
            ]
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return logits, sample_rows
