"""Speculative decoding: a decoding sequence proposes tokens, the target model scores the
sequence's next token and every proposed one in one forward (a short chunk over the paged KV), and
the sequence keeps the proposals up to the first that the target would not have produced, plus the
target's own token after them. Two proposers: `ngram` proposes the tokens that followed the latest
earlier occurrence of its last n tokens in its own context (prompt lookup); `draft_model` runs a
small model of the same vocabulary greedily (`pdserve.engine.spec_decode.draft_model`).

Verification samples each of the k+1 positions exactly as plain decoding samples its next token
(greedy: argmax; otherwise the exponential race, seeded rows with the noise keyed by the request's
seed and the output's index), and a proposal is kept only while it equals that sample. So the
tokens are the ones plain decoding gives: the same tokens for greedy and seeded requests, the same
distribution for the rest. For proposals that are one token each (a lookup, or a draft model's
argmax: a point mass, not a distribution) this accepts a proposal with the target's probability of
it, as rejection sampling would.

Sequences that speculate: running decodes (one token to compute), not a prefill node's, and
without logprobs, penalties or a structured output (each of those reads the sequence's tokens up to
the sampled position); the others decode as always, in the same batch. How many drafts a sequence
proposes follows its own acceptance so far (`pdserve.engine.spec_decode.pacing`), unless the config's
`adaptive` is off.

The scheduler asks a `Proposer` in two phases: `limit` (how many drafts a sequence may take, so
its blocks and the step's tokens are reserved before anything is proposed), then `draft` for every
speculating sequence of the step at once (a draft model runs one batched forward per position).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.sequence import Sequence

METHODS = ("ngram", "draft_model")
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
DRAFT_MODEL_KEYS = ("model", "draft_tensor_parallel_size", "draft_num_kv_blocks")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` JSON: the n-gram method's keys, and the draft model's."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"
    # pdserve's own key: each sequence's draft limit follows its acceptance (`DraftPacing`)
    adaptive: bool = True
    # draft_model: its checkpoint directory or embedded model's name (given alone, the method is
    # draft_model, as in vLLM)
    model: str | None = None
    # vLLM's key, accepted at 1 only: the draft runs whole on rank 0, whatever the target's size
    draft_tensor_parallel_size: int = 1
    # vLLM's key: a step whose batch holds more running sequences than this verifies no drafts
    # (where extra rows cost a step much, as on a CPU, speculation pays at small batches only)
    disable_by_batch_size: int | None = None
    # pdserve's own key: the draft's KV pool in blocks, the target's taking the rest of the budget
    # (unset: as many blocks as the target's pool, out of the same budget)
    draft_num_kv_blocks: int | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON; ValueError naming what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object")
        method = raw.get("method", "draft_model" if "model" in raw else "ngram")
        if method not in METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is not supported (supported: "
                f"{', '.join(METHODS)})"
            )
        unknown = sorted(set(raw) - {"method", *cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config needs num_speculative_tokens")
        values = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        values["method"] = method
        if method == "draft_model":
            if not isinstance(raw.get("model"), str) or not raw["model"]:
                raise ValueError(
                    "speculative_config method 'draft_model' needs model (a checkpoint directory "
                    "or an embedded model's name)"
                )
            ngram_only = [key for key in NGRAM_KEYS if key in raw]
            if ngram_only:
                raise ValueError(
                    f"speculative_config {ngram_only[0]} is the ngram method's, not draft_model's"
                )
            if raw.get("draft_tensor_parallel_size", 1) != 1:
                raise ValueError(
                    "speculative_config draft_tensor_parallel_size must be 1: the draft runs "
                    "whole on rank 0"
                )
        else:
            draft_only = [key for key in DRAFT_MODEL_KEYS if key in raw]
            if draft_only:
                raise ValueError(
                    f"speculative_config {draft_only[0]} is the draft_model method's, not ngram's"
                )
        for key, value in values.items():
            if key == "adaptive":
                if not isinstance(value, bool):
                    raise ValueError("speculative_config adaptive must be true or false")
            elif key == "model":
                continue
            elif key != "method" and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"speculative_config {key} must be a positive integer")
        config = cls(**values)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("speculative_config prompt_lookup_min exceeds prompt_lookup_max")
        return config


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, for the n the proposer looks up,
    brought up to date with the tokens appended since (the tokens only ever grow: drafts never
    enter them), so a lookup costs the same at any length."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in

    def update(self, token_ids: list[int]) -> None:
        """Index every n-gram that ends before the last token (so a match has a continuation)."""
        stop = len(token_ids) - 1
        for end in range(self.indexed, stop):
            for n in self.sizes:
                if end >= n - 1:
                    self.last_end[n][tuple(token_ids[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, stop)


class Proposer(Protocol):
    """What the scheduler asks for drafts: `limit` for each decoding sequence as it schedules
    it, `draft` once for all it reserved room for, `rollback` after a step verified a sequence's
    drafts, `release` when a sequence leaves the batch (finished, aborted, preempted)."""

    def limit(self, seq: Sequence, k: int) -> int:
        """How many drafts seq may take this step, at most k (0: it decodes plainly)."""
        ...

    def draft(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k drafts for each (sequence, k), all of the step's at once."""
        ...

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Only seq's first num_valid tokens are what the proposer saw: forget the rest."""
        ...

    def release(self, seq: Sequence) -> None:
        """seq left the batch: free what the proposer holds for it."""
        ...


def speculation_limit(seq: Sequence, k: int, adaptive: bool) -> int:
    """At most k drafts for a sequence that may speculate, following its acceptance if adaptive."""
    if not can_speculate(seq.params, seq.prefill_only, seq.constraint is not None):
        return 0
    if adaptive:
        k = seq.draft_pacing.limit(k, seq.num_output_tokens)
    return max(k, 0)


class NgramProposer:
    """Proposals from the sequence's own context: for n from `prompt_lookup_max` down to
    `prompt_lookup_min`, the latest earlier occurrence of its last n tokens, and up to k tokens
    that followed it. A lookup is cheap: `limit` makes it, so the scheduler reserves exactly the
    drafts `draft` then gives."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self.adaptive = config.adaptive

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.sizes)

    def propose(self, token_ids: list[int], k: int, index: NgramIndex | None = None) -> list[int]:
        """index: the sequence's own, kept between calls (a fresh one is built otherwise)."""
        if k <= 0:
            return []
        index = index or self.new_index()
        index.update(token_ids)
        length = len(token_ids)
        for n in reversed(self.sizes):
            if n >= length:
                continue
            end = index.last_end[n].get(tuple(token_ids[length - n :]))
            if end is not None:
                return token_ids[end + 1 : end + 1 + k]
        return []

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        if seq.ngram_index is None:
            seq.ngram_index = self.new_index()
        return self.propose(seq.token_ids, k, seq.ngram_index)

    def limit(self, seq: Sequence, k: int) -> int:
        k = speculation_limit(seq, k, self.adaptive)
        return len(self._lookup(seq, k)) if k > 0 else 0

    def draft(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self._lookup(seq, k) for seq, k in batch]

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        pass  # the index holds the sequence's own tokens only

    def release(self, seq: Sequence) -> None:
        pass


def can_speculate(params: SamplingParams, prefill_only: bool, constrained: bool) -> bool:
    """Whether a decoding sequence's next tokens may be verified several at a time."""
    return not (prefill_only or constrained or params.logprobs is not None or params.has_penalties)


def accepted(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a speculating sequence keeps: the drafts up to the first that differs from the
    target's sample at its position, then the target's sample there (or after the last draft).
    sampled has one token per verified position: len(drafts) + 1."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == sampled[kept]:
        kept += 1
    return sampled[: kept + 1]


@dataclass(frozen=True, slots=True)
class VerifiedRow:
    """One verified position of a speculating sequence, as the sampler sees a sequence: its
    parameters and which output of the request a token sampled there is."""

    params: SamplingParams
    sample_index: int
    constraint: None = None
