"""A step's short multi-token chunks as decode rows, so they replay a decode graph.

A speculating sequence computes its next token and its k drafts (1 + k tokens); a sequence that
structured outputs gave forced tokens computes them with its next token (1 + m tokens). Both are
chunks, which the varlen attention kernel would score and no captured graph holds. Here every
token of such a chunk becomes a decode row of its own: its sequence's block tables, and a context
that ends at the token itself (its sequence's context after the step, less the chunk's tokens
after it). Each layer stores the K/V of every row before any row attends, so row j of a chunk
reads rows 0..j of its own chunk as the chunk's causal mask would: the same attention, scored by
the decode kernel a plain decode step uses.

Rows stay in token order, so the hidden state of a chunk's token is at the row it had in the
chunk layout, and the logits of a sequence's next token and drafts are gathered as before. The
rows are padded to the smallest captured row count that holds them: padding rows write no KV
(slot -1), read one token of context and are never gathered. No draft is padded: a sequence with
fewer drafts than another takes fewer rows, so a padded position can never be accepted.

Row counts to capture: the decode batch sizes up to `max_batch_size`, then every multiple of
`ROW_STRIDE` up to `max_batch_size` x (1 + k), the step's token budget permitting.
"""

from __future__ import annotations

import torch

from pdserve.engine.execution.decode_graphs import capture_sizes
from pdserve.engine.execution.forward_batch import AttentionBatch

# Beyond the largest decode batch, row counts are captured this far apart: a verification step
# there is padded by at most ROW_STRIDE - 1 rows (under 10 % from 320 rows up).
ROW_STRIDE = 32
# Forced tokens computed with a sequence's next token that a graph still takes (structured
# outputs append up to 64; a longer run of them is a chunk for the eager forward).
FORCED_GRAPH_TOKENS = 8


def graph_row_sizes(
    max_batch_size: int, max_query_len: int = 1, max_rows: int | None = None
) -> list[int]:
    """Row counts to capture, ascending: `capture_sizes(max_batch_size)`, then every multiple of
    ROW_STRIDE above it up to max_batch_size x max_query_len (or max_rows, if smaller: a step
    holds no more tokens than its budget), and that bound itself."""
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    sizes = capture_sizes(max_batch_size)
    top = max_batch_size * max_query_len
    if max_rows is not None:
        top = max(max_batch_size, min(top, max_rows))
    first = (max_batch_size // ROW_STRIDE + 1) * ROW_STRIDE
    sizes += range(first, top, ROW_STRIDE)
    if top > max_batch_size:
        sizes.append(top)
    return sizes


def graph_query_len(num_speculative_tokens: int, forced_tokens: bool) -> int:
    """The longest chunk a sequence's decode rows replay in a graph: 1 + its drafts, or 1 + the
    forced tokens a graph takes; 1 (plain decode steps only) when neither is on."""
    return 1 + max(num_speculative_tokens, FORCED_GRAPH_TOKENS if forced_tokens else 0)


def as_decode_rows(batch: AttentionBatch) -> AttentionBatch:
    """The batch with every token a decode row (see the module's docstring); slots unchanged."""
    starts = batch.query_start_loc
    query_lens = starts[1:] - starts[:-1]
    num_tokens = int(starts[-1])
    seq_of_row = torch.repeat_interleave(
        torch.arange(query_lens.shape[0], device=starts.device), query_lens
    )
    # Tokens of its chunk after each row: the chunk's end less the row's index, less one.
    rows = torch.arange(num_tokens, device=starts.device)
    after = starts[1:][seq_of_row] - 1 - rows
    seq_lens = batch.seq_lens[seq_of_row] - after
    return AttentionBatch(
        slot_mapping=batch.slot_mapping,
        block_tables=batch.block_tables[seq_of_row],
        seq_lens=seq_lens,
        query_start_loc=torch.arange(num_tokens + 1, device=starts.device),
        max_query_len=1,
        group_slot_mappings=batch.group_slot_mappings,
        group_block_tables=tuple(t[seq_of_row] for t in batch.group_block_tables),
    )
