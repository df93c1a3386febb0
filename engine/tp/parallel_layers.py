"""The layers that talk to the other tensor-parallel ranks: a row-parallel projection (its input
split across ranks, partial outputs summed by an all-reduce), the vocabulary-parallel embedding
(each rank looks up its rows of the vocabulary, the all-reduce assembles them) and LM head (each
rank scores its rows, rank 0 gathers the logits). Column-parallel projections need no layer of
their own: a plain linear layer (`pdserve.engine.cpu.linear.Linear`) over the rank's output rows.

Every projection runs through `pdserve.engine.cpu.linear.linear`: F.linear, or oneDNN on a weight packed
once after loading where the node packs its linear layers (CPU, float32).

Without a group (one rank) each is exactly the plain layer it replaces.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.engine.cpu.linear import linear
from pdserve.engine.tp.group import TPGroup


class RowParallelLinear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, group: TPGroup | None
    ) -> None:
        """in_features: this rank's part of the input; the bias, whole, is added once."""
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # set by engine.cpu.linear.pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return linear(x, self.weight, self.bias, self.packed)
        y = self.group.all_reduce(linear(x, self.weight, None, self.packed))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: range, hidden_size: int, group: TPGroup | None) -> None:
        """rows: the token ids whose embeddings this rank holds."""
        super().__init__()
        self.group = group
        self.start, self.stop = rows.start, rows.stop
        self.weight = nn.Parameter(torch.empty(len(rows), hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    def __init__(
        self, rows: range, hidden_size: int, vocab_size: int, group: TPGroup | None
    ) -> None:
        """rows: the token ids this rank scores; each rank holds `per_rank` rows' room."""
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(len(rows), hidden_size))
        self.per_rank = -(-vocab_size // group.size) if group is not None else vocab_size
        self.packed: torch.Tensor | None = None  # set by engine.cpu.linear.pack

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [n, vocab] on rank 0; None on the others (which take part)."""
        logits = linear(hidden, self.weight, None, self.packed).float()
        if self.group is None:
            return logits
        pad = self.per_rank - logits.shape[-1]
        if pad:
            logits = F.pad(logits, (0, pad))
        parts = self.group.gather_to_first(logits)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
