"""One step's plan as plain data: the token ids, positions and KV slots of every scheduled token,
each sequence's context length and block table, and which sequences sample. The model runner
turns it into tensors; under tensor parallelism rank 0 builds it and every other rank receives
it, so all ranks run the same forward over their own shards.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from pdserve.engine.execution.forward_batch import AttentionBatch
from pdserve.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    # Python arrays, not lists: they turn into tensors by a copy of their bytes, not element by
    # element, which matters at a few hundred sequences per step (and they pickle as bytes).
    input_ids: array  # "q", one per token
    positions: array  # "q"
    slots: array  # "q": where each token's K and V go in the pool
    seq_lens: array  # "q", one per sequence: its context after this step
    query_start: array  # "q", num_seqs + 1
    block_tables: array  # "i", num_seqs x width, padded with 0
    width: int
    sample_rows: list[int]  # indices of sequences whose chunk ends their tokens: they sample
    max_query_len: int
    # Positions whose logits each sampling sequence needs, by sample row: its last one, or a
    # speculating sequence's next token and every draft (1 + drafts); empty: one each.
    sample_counts: list[int] = field(default_factory=list)
    # A model mixing layer kinds: each further KV group's slots and padded block tables, as
    # `slots` and `block_tables` are group 0's.
    group_slots: list[array] = field(default_factory=list)
    group_tables: list[array] = field(default_factory=list)

    @classmethod
    def from_scheduled(cls, out: SchedulerOutput, block_size: int) -> StepPlan:
        bs = block_size
        input_ids = array("q")
        positions = array("q")
        slots = array("q")
        seq_lens = array("q")
        query_start = array("q", [0])
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_counts: list[int] = []
        max_query_len = 1
        for index, item in enumerate(out.scheduled):
            seq = item.seq
            start, n = seq.num_computed_tokens, item.num_new_tokens
            end = start + n
            table = seq.block_table
            drafts = seq.draft_token_ids
            if n == 1:  # a decode: the common case at large batch, kept to a few appends
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                if drafts:
                    input_ids.extend(drafts)
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                max_query_len = max(max_query_len, n)
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            tables.append(table)
            if end == seq.num_tokens + len(drafts):  # the chunk reaches the end: it samples
                sample_rows.append(index)
                sample_counts.append(1 + len(drafts))
        flat, width = padded_tables(tables)
        speculating = len(sample_counts) != sum(sample_counts)
        group_slots, group_tables = _further_groups(out, bs, width)
        return cls(
            input_ids,
            positions,
            slots,
            seq_lens,
            query_start,
            flat,
            width,
            sample_rows,
            max_query_len,
            sample_counts if speculating else [],
            group_slots,
            group_tables,
        )

    @classmethod
    def from_chunks(
        cls, chunks: list[tuple[list[int], int, list[int], bool]], block_size: int
    ) -> StepPlan:
        """A plan over chunks not of the scheduler's sequences (a draft model's): each is (token
        ids, position of the first, block table, whether its last position samples)."""
        bs = block_size
        input_ids, positions, slots = array("q"), array("q"), array("q")
        seq_lens, query_start = array("q"), array("q", [0])
        sample_rows: list[int] = []
        max_query_len = 1
        for index, (tokens, start, table, samples) in enumerate(chunks):
            end = start + len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start.append(end - start + query_start[-1])
            max_query_len = max(max_query_len, len(tokens))
            if samples:
                sample_rows.append(index)
        flat, width = padded_tables([table for _, _, table, _ in chunks])
        return cls(
            input_ids,
            positions,
            slots,
            seq_lens,
            query_start,
            flat,
            width,
            sample_rows,
            max_query_len,
        )

    @property
    def num_logit_rows(self) -> int:
        return sum(self.sample_counts) if self.sample_counts else len(self.sample_rows)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """Input ids, positions and the attention batch as host tensors sharing the arrays'
        memory: the step copies them to the device once, into the model's inputs or a graph's."""
        batch = AttentionBatch(
            slot_mapping=_tensor(self.slots),
            block_tables=_tensor(self.block_tables).view(-1, self.width),
            seq_lens=_tensor(self.seq_lens),
            query_start_loc=_tensor(self.query_start),
            max_query_len=self.max_query_len,
            group_slot_mappings=tuple(_tensor(slots) for slots in self.group_slots),
            group_block_tables=tuple(
                _tensor(tables).view(-1, self.width) for tables in self.group_tables
            ),
        )
        return _tensor(self.input_ids), _tensor(self.positions), batch


def _tensor(values: array) -> torch.Tensor:
    """int64 ("q") or int32 ("i") values, sharing the array's memory (and keeping it alive)."""
    dtype = torch.long if values.typecode == "q" else torch.int32
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


def _further_groups(out: SchedulerOutput, bs: int, width: int) -> tuple[list[array], list[array]]:
    """The slots and padded tables of every KV group after the first, for the scheduled
    tokens (none for a model of one group)."""
    if not out.scheduled or len(out.scheduled[0].seq.block_tables) < 2:
        return [], []
    num_groups = len(out.scheduled[0].seq.block_tables)
    group_slots, group_tables = [], []
    for g in range(1, num_groups):
        slots = array("q")
        tables = []
        for item in out.scheduled:
            seq = item.seq
            table = seq.block_tables[g]
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(table)
        flat, _ = padded_tables(tables, width)
        group_slots.append(slots)
        group_tables.append(flat)
    return group_slots, group_tables


def padded_tables(tables: list[list[int]], width: int = 0) -> tuple[array, int]:
    """Block tables as one flat array, each padded with zeros to the longest's width (or to
    `width`, if wider)."""
    width = max([width, *map(len, tables)])
    padding = array("i", bytes(4 * width))
    flat = array("i")
    for table in tables:
        flat.extend(table)
        flat.extend(padding[: width - len(table)])
    return flat, width
