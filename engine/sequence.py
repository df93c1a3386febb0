"""The state of one request inside an engine: its tokens, how many have KV in the cache, and its
block table. Everything derivable from those is a property."""

from __future__ import annotations

import enum
from typing import Any

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.spec_decode.pacing import DraftPacing


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # A prefill-only sequence that sampled its first token: out of the batch, its blocks kept
    # for a KV handoff.
    PREFILLED = "prefilled"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        prefill_only: bool = False,
        output_offset: int = 0,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        # Its blocks in each KV group (`pdserve.engine.kv.kv_manager`): one table per group of
        # layers, -1 where a block no query reads went back to the pool.
        self.block_tables: list[list[int]] = [[]]
        # The chained hashes of its full blocks, as far as they were needed (prefix caching).
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None  # stop | length | abort
        self.num_preemptions = 0
        # On a prefill node: leave the batch after the first token, keeping the blocks.
        self.prefill_only = prefill_only
        # Outputs of this request sampled before this sequence's own (on another node, or by an
        # earlier attempt): seeded sampling goes on from there, its noise keyed by sample_index.
        self.output_offset = output_offset
        self.output_logprobs: list[dict] = []
        # The output's constraint (`pdserve.engine.grammar.Constraint`), if the request has one.
        self.constraint: Any = None
        # Tokens proposed to follow token_ids, verified by the step they are scheduled in
        # (`pdserve.engine.spec_decode.speculation`); not part of the sequence until accepted.
        self.draft_token_ids: list[int] = []
        self.draft_pacing = DraftPacing()  # its drafts so far, since it started decoding here
        self.ngram_index: Any = None  # the n-gram proposer's index of token_ids
        # The draft_model proposer's KV of this sequence: its blocks in the draft's pool, and how
        # many of token_ids (then of its drafts) have draft KV there.
        self.draft_block_table: list[int] = []
        self.num_draft_computed_tokens = 0
        # Its prefix was looked up in the KV tiers below the pool since it was last admitted.
        self.tiers_looked_up = False

    @property
    def block_table(self) -> list[int]:
        """Its table in the first KV group: its only one unless the model mixes layer kinds."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_request_prompt_tokens(self) -> int:
        """The request's own prompt: every token after it is an output of the request, sampled
        here or before this sequence (earlier outputs travel to a node as part of its prompt)."""
        return self.num_prompt_tokens - self.output_offset

    @property
    def request_output_ids(self) -> list[int]:
        """Every output of the request so far, this sequence's and those sampled before it."""
        return self.token_ids[self.num_request_prompt_tokens :]

    @property
    def sample_index(self) -> int:
        """Which output of the request the next sampled token is (0 for the first): with the
        seed, the key of that token's sampling noise wherever it is sampled."""
        return self.output_offset + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> str | None:
        """The finish reason after the last appended token, if this sequence is done."""
        last = self.token_ids[-1]
        if last in self.eos_token_ids or last in self.params.stop_token_ids:
            return "stop"
        if self.constraint is not None:  # a complete output (even with ignore_eos) ends it
            self.constraint.sync(self.request_output_ids)
            if self.constraint.terminated:
                return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
