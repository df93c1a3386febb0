"""The tensors one model forward needs besides token ids: where each token's K/V goes and what
each sequence's queries attend to. Built by the model runner, read by every attention layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] context length after this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    max_query_len: int
