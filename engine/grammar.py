"""Structured outputs on a node: each distinct constraint (`StructuredOutput`) compiled once for
the model's tokenizer by xgrammar, off the step loop, and kept (bounded); a sequence's `Constraint`
matches its outputs against the compiled grammar and gives the sampler each step's allowed
tokens as a bitmask.

A constraint follows the request's outputs, wherever they were sampled: before each fill it
accepts every output token of the sequence it has not seen yet, so a sequence that arrives from
another node (its first token sampled there), is preempted and recomputed, or is re-prefilled
after a failover is matched exactly as if one node had made it all. A constraint whose spec has
`after` (a reasoning model's end-of-reasoning tokens) is inactive until those tokens appear in the
output: the reasoning is sampled freely, the answer under the grammar, and since the start is found
in the outputs themselves, it is found the same way on every node that samples.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pdserve.cluster.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

# Compiled grammars kept per node (the least recently used goes first).
CACHE_SIZE = 512


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (the message says why), or output that broke it."""


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """The compiled grammars of one node's model: `request(spec)` gives a future, done once the
    grammar is compiled (at once when cached); compilation runs on one thread of its own."""

    def __init__(
        self, model_dir: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...]
    ) -> None:
        """vocab_size: the width of the model's logits (at least the tokenizer's)."""
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        self.hits = 0
        self.misses = 0

    def request(self, spec: StructuredOutput) -> Future:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutput) -> Any:
        try:
            compiler = self._ensure_compiler()
            if spec.kind == "json":
                # No free whitespace between tokens: a small model pads with it forever.
                return compiler.compile_json_schema(
                    spec.spec, any_whitespace=False, strict_mode=True
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choices))
            return compiler.compile_grammar(spec.spec)
        except Exception as exc:  # the compiler's message names what it cannot take
            with self._lock:
                self._cache.pop(spec.key, None)  # a failure is not kept
            raise ConstraintError(_compile_message(spec.kind, exc)) from None

    def _ensure_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(
                tokenizer_file=str(self.model_dir / "tokenizer.json")
            )
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compile_message(kind: str, exc: Exception) -> str:
    """xgrammar's message without its source location: `[time] file.cc:123: what`."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "] " in text and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
    return f"the {what[kind]} cannot be used: {text}"


def _timeout_message(kind: str, timeout_s: float) -> str:
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
    grammar = "the grammar" if kind == "grammar" else f"the grammar of the {what[kind]}"
    return f"{grammar} did not compile within {timeout_s:g} s (--grammar-compile-timeout-s)"


class Constraint:
    """One sequence's matcher over its compiled grammar (once `future` is done)."""

    def __init__(self, spec: StructuredOutput, future: Future) -> None:
        self.spec = spec
        self.future = future
        self._matcher: Any = None
        self.num_accepted = 0  # output tokens matched so far
        self._row: torch.Tensor | None = None  # for forced_token
        self._expired: str | None = None  # why the sequence stopped waiting for its grammar
        self.after = list(spec.after)
        # Where in the output the grammar begins (None: its `after` tokens have not appeared).
        self.start: int | None = None if self.after else 0
        self._searched = 0  # outputs searched for `after` so far

    @property
    def ready(self) -> bool:
        return self._expired is not None or self.future.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled, once its compilation ended or was given up
        (else None)."""
        if self._expired is not None:
            return self._expired
        if not self.future.done() or self.future.exception() is None:
            return None
        return str(self.future.exception())

    def expire(self, timeout_s: float) -> None:
        """Stop waiting for the grammar, which did not compile within timeout_s: `ready`, with
        that as its `error`. The compile itself cannot be stopped: it runs on, and its grammar
        is cached for the next request with this spec."""
        if not self.future.done():
            self._expired = _timeout_message(self.spec.kind, timeout_s)

    @property
    def active(self) -> bool:
        """The grammar applies to the next token (after `sync`)."""
        return self._matcher is not None

    def _find_start(self, outputs: list[int]) -> None:
        """Where the grammar begins: past the first occurrence of `after` in the outputs."""
        n = len(self.after)
        at = max(0, self._searched - n + 1)
        for i in range(at, len(outputs) - n + 1):
            if outputs[i : i + n] == self.after:
                self.start = i + n
                return
        self._searched = len(outputs)

    def sync(self, outputs: list[int]) -> None:
        """Accept the output tokens not accepted yet (the request's outputs so far); before its
        `after` tokens appear, only look for them."""
        if self.start is None:
            self._find_start(outputs)
            if self.start is None:
                return
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self.future.result())
        for token in outputs[self.start + self.num_accepted :]:
            if not self._matcher.accept_token(token):
                raise ConstraintError(f"token {token} breaks the {self.spec.kind} constraint")
            self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into row `row` of bitmask (after `sync`, when `active`)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def forced_token(self, vocab_size: int) -> int | None:
        """The next token where the grammar allows that one alone (after `sync`), else None. A
        grammar that forces no text forces no token, so most calls end at that cheap test."""
        matcher = self._matcher
        if matcher is None or matcher.is_terminated() or not matcher.find_jump_forward_string():
            return None
        if self._row is None:
            import xgrammar

            self._row = xgrammar.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(self._row)
        words = self._row[0].nonzero()
        if words.numel() != 1:
            return None
        word = int(words[0])
        bits = int(self._row[0, word]) & 0xFFFFFFFF
        if bits & (bits - 1):  # more than one token in that word
            return None
        return 32 * word + bits.bit_length() - 1


_BITMASKS: dict[int, torch.Tensor] = {}  # by vocabulary size: rows reused step after step
_BITS = torch.arange(32, dtype=torch.int32)


def apply_constraints(logits: torch.Tensor, rows: list[int], constraints: list[Constraint]) -> None:
    """In place: every token a row's constraint does not allow next gets -inf (rows `rows` of
    logits only)."""
    import xgrammar

    batch, vocab = logits.shape
    bitmask = _BITMASKS.get(vocab)
    if bitmask is None or bitmask.shape[0] < batch:
        bitmask = xgrammar.allocate_token_bitmask(max(batch, 64), vocab)
        _BITMASKS[vocab] = bitmask
    for row, constraint in zip(rows, constraints):
        constraint.fill(bitmask, row)
    if logits.device.type != "cpu":  # xgrammar's kernel for the device
        mask = bitmask[:batch].to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, mask, indices=rows)
        return
    # On a CPU, unpacking the bits with torch is several times faster than xgrammar's kernel.
    index = torch.tensor(rows)
    words = bitmask[index]  # [R, ceil(vocab / 32)] int32, bit j of word w: token 32 * w + j
    allowed = (words.unsqueeze(-1) >> _BITS).bitwise_and_(1).view(len(rows), -1)[:, :vocab]
    logits[index] = logits[index].masked_fill_(allowed == 0, float("-inf"))
