"""The tensors one model forward needs besides token ids: where each token's K/V goes and what
each sequence's queries attend to. Built by the model runner, read by every attention layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] context length after this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    max_query_len: int
    # A model mixing layer kinds has a KV group per kind (`pdserve.engine.kv.groups`): the slots
    # and block tables above are group 0's, these each further group's (-1: a block given back).
    group_slot_mappings: tuple[torch.Tensor, ...] = field(default=())
    group_block_tables: tuple[torch.Tensor, ...] = field(default=())

    def group(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot mapping, block tables) of KV group `index`."""
        if index == 0:
            return self.slot_mapping, self.block_tables
        return self.group_slot_mappings[index - 1], self.group_block_tables[index - 1]
