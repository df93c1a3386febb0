"""Execution of one scheduled step: turns a SchedulerOutput into tensors (token ids, positions,
slots, block tables), runs the model over the paged pool and returns last-position logits."""

from __future__ import annotations

from array import array

import torch

from engine.decode_graphs import DecodeGraphs
from engine.forward_batch import AttentionBatch
from engine.kv_cache import KVPool
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import SchedulerOutput
from kernels.ops import Ops


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, ops: Ops, device: str) -> None:
        self.model = model
        self.pool = pool
        self.ops = ops
        self.device = torch.device(device)
        self.block_size = pool.layout.block_size
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Replay decode-only steps of up to max_batch_size sequences from CUDA graphs."""
        graphs = DecodeGraphs(
            self.model,
            self.pool,
            self.ops,
            self.device,
            max_batch_size,
            -(-max_model_len // self.block_size),
        )
        graphs.capture()
        self.decode_graphs = graphs

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[int]]:
        """Returns input ids, positions, the attention batch (all on the host: the step copies
        them to the device once, into the model's inputs or a graph's) and the indices (into
        out.scheduled) of sequences that sample; their logits rows come in that order."""
        bs = self.block_size
        # Python arrays, not lists: they turn into tensors by a copy of their bytes, not element
        # by element, which matters at a few hundred sequences per step.
        input_ids = array("q")
        positions = array("q")
        slots = array("q")
        seq_lens = array("q")
        query_start = array("q", [0])
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        max_query_len = 1
        for index, item in enumerate(out.scheduled):
            seq = item.seq
            start, n = seq.num_computed_tokens, item.num_new_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # a decode: the common case at large batch, kept to a few appends
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                max_query_len = max(max_query_len, n)
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            tables.append(table)
            if end == seq.num_tokens:  # the chunk reaches the end: a token is sampled
                sample_rows.append(index)
        width = max(map(len, tables))
        padding = array("i", bytes(4 * width))
        flat = array("i")
        for table in tables:
            flat.extend(table)
            flat.extend(padding[: width - len(table)])
        batch = AttentionBatch(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(flat).view(-1, width),
            seq_lens=self._tensor(seq_lens),
            query_start_loc=self._tensor(query_start),
            max_query_len=max_query_len,
        )
        ids = self._tensor(input_ids)
        pos = self._tensor(positions)
        return ids, pos, batch, sample_rows

    @staticmethod
    def _tensor(values: array) -> torch.Tensor:
        """int64 ("q") or int32 ("i") values, sharing the array's memory (and keeping it alive)."""
        dtype = torch.long if values.typecode == "q" else torch.int32
        if not values:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(values, dtype=dtype)

    def _to_device(self, batch: AttentionBatch) -> AttentionBatch:
        return AttentionBatch(
            slot_mapping=batch.slot_mapping.to(self.device),
            block_tables=batch.block_tables.to(self.device),
            seq_lens=batch.seq_lens.to(self.device),
            query_start_loc=batch.query_start_loc.to(self.device),
            max_query_len=batch.max_query_len,
        )

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [num_sampling, vocab] float32 on the model's device, indices of
        sampling sequences): the sampler runs where the logits are, so only token ids come back."""
        ids, pos, batch, sample_rows = self.prepare(out)
        graphs = self.decode_graphs
        decode_only = batch.max_query_len == 1
        if (
            graphs is not None
            and decode_only
            and graphs.fits(len(out.scheduled), batch.block_tables.shape[1])
        ):
            hidden = graphs.run(ids, pos, batch)  # copies the host inputs into its buffers
        else:
            ids, pos = ids.to(self.device), pos.to(self.device)
            hidden = self.model(ids, pos, self._to_device(batch), self.pool, self.ops)
        if not sample_rows:
            return torch.empty(0, device=self.device), sample_rows
        if len(sample_rows) == hidden.shape[0]:  # all decodes: row i is sequence i's last token
            logits = self.model.compute_logits(hidden)
        else:
            last = batch.query_start_loc[1:] - 1
            rows = last[torch.tensor(sample_rows)].to(self.device)
            logits = self.model.compute_logits(hidden[rows])
        return logits, sample_rows
