"""Decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels; at small batches launching them from Python
costs more than running them. At start-up the model's forward is captured once per batch size in
`capture_sizes` over static input buffers; a decode-only step of n sequences is then copied into
those buffers, padded to the smallest captured size that holds it, and replayed as one graph.

Padding rows write no KV (slot -1), attend to the first token of whatever block their table row
names (a read of the pool, never a write) and are dropped before sampling. The buffers' block
tables are as wide as `max_model_len` needs, so one graph serves every context length. A model
whose layers form several KV groups has a slot mapping and block tables per group among the
buffers; a windowed layer's kernels read a window's span, whatever the context length.
"""

from __future__ import annotations

import bisect
import logging

import torch

from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.kv.cache import KVPool
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.kernels.op_table import Ops

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, and max_batch_size itself: a step is padded by at most
    7 rows (44 % of a 16-row replay at 9 sequences, under 8 % from 81 up)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += range(8, max_batch_size, 8)
    sizes.append(max_batch_size)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest of the ascending `sizes` that holds num_seqs rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeInputs:
    """Static buffers a captured graph reads: one row per sequence, `max_batch_size` rows."""

    def __init__(
        self,
        max_batch_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        """num_groups: the model's KV groups, each with slots and tables of its own."""
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        rows = max_batch_size
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mappings = [
            torch.full((rows,), -1, dtype=torch.long, device=device) for _ in range(num_groups)
        ]
        self.tables = [
            torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
            for _ in range(num_groups)
        ]
        self.slot_mapping, self.block_tables = self.slot_mappings[0], self.tables[0]
        self.seq_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.long, device=device)

    def view(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """The first `size` rows as the model's inputs (always the same tensors for one size)."""
        batch = AttentionBatch(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            group_slot_mappings=tuple(s[:size] for s in self.slot_mappings[1:]),
            group_block_tables=tuple(t[:size] for t in self.tables[1:]),
        )
        return self.input_ids[:size], self.positions[:size], batch

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, size: int
    ) -> None:
        """Copy a decode batch of n <= size rows in (from the host or the device); rows n..size
        become padding."""
        n = input_ids.shape[0]
        width = batch.block_tables.shape[1]
        if n > size or size > self.max_batch_size:
            raise ValueError(f"{n} rows do not fit a captured size of {size}")
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block tables of {width} blocks exceed {self.max_blocks_per_seq}")
        if len(batch.group_block_tables) != len(self.tables) - 1:
            raise ValueError(
                f"a batch of {1 + len(batch.group_block_tables)} KV groups, buffers of "
                f"{len(self.tables)}"
            )
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        for g in range(len(self.tables)):
            slot_mapping, block_tables = batch.group(g)
            self.slot_mappings[g][:n].copy_(slot_mapping)
            # Columns past `width` keep older ids: attention reads a row only up to its seq_len.
            self.tables[g][:n, :width].copy_(block_tables)
            # Rows that held real sequences in an earlier, larger step must not write slots.
            self.slot_mappings[g][n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)


class DecodeGraphs:
    """The model's decode forward at each captured batch size, and the step that replays it."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        ops: Ops,
        device: torch.device,
        max_batch_size: int,
        max_blocks_per_seq: int,
        sizes: list[int] | None = None,
        max_query_len: int = 1,
    ) -> None:
        """sizes: the row counts to capture (default `capture_sizes(max_batch_size)`); above
        max_batch_size only steps of chunks of up to max_query_len tokens, as decode rows
        (`pdserve.engine.execution.decode_rows`), use them."""
        self.model = model
        self.pool = pool
        self.ops = ops
        self.max_batch_size = max_batch_size
        self.max_query_len = max_query_len
        self.sizes = sorted(sizes) if sizes else capture_sizes(max_batch_size)
        if max_query_len == 1 and self.sizes[-1] > max_batch_size:
            raise ValueError(f"size {self.sizes[-1]} exceeds max_batch_size {max_batch_size}")
        self.inputs = DecodeInputs(
            self.sizes[-1], max_blocks_per_seq, device, pool.layout.groups.num_groups
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.row_steps = 0  # steps of chunks run as decode rows (replayed or, off CUDA, eager)

    def _forward(self, size: int) -> torch.Tensor:
        ids, pos, batch = self.inputs.view(size)
        return self.model(ids, pos, batch, self.pool, self.ops)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool. The
        inputs then hold padding only: the warm-up and capture runs write no KV."""
        mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the kernels and creates library handles outside
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def fits(self, num_seqs: int, width: int) -> bool:
        """Whether a decode-only step of num_seqs sequences replays a graph."""
        largest = min(self.max_batch_size, self.sizes[-1])
        return num_seqs <= largest and width <= self.inputs.max_blocks_per_seq

    def fits_rows(self, max_query_len: int, num_tokens: int, width: int) -> bool:
        """Whether a step of chunks of up to max_query_len tokens, num_tokens in all, replays a
        graph as decode rows (a verification step, or decodes that carry forced tokens)."""
        return (
            max_query_len <= self.max_query_len
            and num_tokens <= self.sizes[-1]
            and width <= self.inputs.max_blocks_per_seq
        )

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode-only batch of n sequences. A size without
        a captured graph (nothing is captured off CUDA) runs eagerly on the same padded rows."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"{n} sequences exceed the largest captured size {self.sizes[-1]}")
        self.inputs.load(input_ids, positions, batch, size)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        self.replays += 1
        return self.outputs[size][:n]
