"""Execution of one scheduled step: turns a SchedulerOutput into tensors (token ids, positions,
slots, block tables), runs the model over the paged pool and returns last-position logits."""

from __future__ import annotations

import torch

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

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[int]]:
        """Returns input ids, positions, the attention batch and the indices (into out.scheduled)
        of sequences that sample; their logits rows come in that order."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for index, item in enumerate(out.scheduled):
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            query_start.append(query_start[-1] + item.num_new_tokens)
            tables.append(table)
            if item.samples:
                sample_rows.append(index)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.long, device=dev),
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, batch, sample_rows

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [num_sampling, vocab] float32 on CPU, indices of sampling sequences)."""
        for src, dst in out.block_copies:
            self.pool.kv[:, :, dst].copy_(self.pool.kv[:, :, src])
        ids, pos, batch, sample_rows = self.prepare(out)
        hidden = self.model(ids, pos, batch, self.pool, self.ops)
        if not sample_rows:
            return torch.empty(0), sample_rows
        last = batch.query_start_loc[1:] - 1
        rows = last[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(hidden[rows])
        return logits.cpu(), sample_rows
