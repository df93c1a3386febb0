"""A grammar that compiles for longer than `grammar_compile_timeout_s` ends its request with an
error naming the limit and its flag, holding no KV block, while requests without a constraint are
served; the compile runs on and its grammar is cached; a timeout not reached changes nothing.

The slow compile is injected: `Grammars._compile` blocks until the test releases it (or two
minutes), far past the 0.2 s timeout however quiet or busy the machine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.cluster.structured_output import StructuredOutput
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.grammar import Grammars

YES_NO = StructuredOutput(kind="choice", choices=["yes", "no"])
LEFT_RIGHT = StructuredOutput(kind="choice", choices=["left", "right"])
PROMPT = "Once upon a time there was a cat."


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every grammar compile waits for this event (at most two minutes) before compiling."""
    event = threading.Event()
    compile_ = Grammars._compile

    def slow_compile(self: Grammars, spec: StructuredOutput) -> object:
        event.wait(120)
        return compile_(self, spec)

    monkeypatch.setattr(Grammars, "_compile", slow_compile)
    yield event
    event.set()  # the compile thread finishes rather than holding the process at exit


def drain(llm: LLM) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_a_grammar_past_its_compile_timeout_ends_its_request_and_holds_nothing(released):
    llm = LLM("pdserve-stories", num_kv_blocks=64, block_size=16, grammar_compile_timeout_s=0.2)
    engine, bm = llm.engine, llm.engine.block_manager
    ids = llm.tokenizer.encode(PROMPT)
    engine.add_request("slow", ids, SamplingParams(max_tokens=4, structured=YES_NO))
    engine.add_request("plain", ids, SamplingParams(max_tokens=8, temperature=0))
    t0 = time.monotonic()
    outputs = drain(llm)
    assert time.monotonic() - t0 < 60  # ended by its deadline, not by the compile
    [slow] = outputs["slow"]
    assert slow.finished and slow.finish_reason == "abort" and not slow.new_token_ids
    assert slow.error == (
        "the grammar of the choice did not compile within 0.2 s (--grammar-compile-timeout-s)"
    )
    # The request without a constraint, submitted with it, is served.
    plain = outputs["plain"]
    assert plain[-1].finished and sum(len(o.new_token_ids) for o in plain) == 8
    assert bm.num_free_blocks == bm.num_blocks and not engine.seqs
    # A later compile queues behind the one still running, bounded by its own deadline.
    with pytest.raises(ValueError, match=r"within 0\.2 s \(--grammar-compile-timeout-s\)"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured=LEFT_RIGHT))
    assert bm.num_free_blocks == bm.num_blocks and not engine.seqs
    # The compile ran on and its grammar is cached: the same spec is served at once.
    released.set()
    engine.grammars.request(YES_NO).result(timeout=120)
    [out] = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, structured=YES_NO))
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert bm.num_free_blocks == bm.num_blocks


def test_a_compile_within_its_timeout_changes_nothing(monkeypatch):
    compile_ = Grammars._compile

    def slower_compile(self: Grammars, spec: StructuredOutput) -> object:
        time.sleep(0.3)  # the request waits for it, well inside the timeout
        return compile_(self, spec)

    monkeypatch.setattr(Grammars, "_compile", slower_compile)
    llm = LLM("pdserve-stories", num_kv_blocks=64, block_size=16, grammar_compile_timeout_s=120)
    params = [
        SamplingParams(max_tokens=4, temperature=0, structured=YES_NO),
        SamplingParams(max_tokens=8, temperature=0),
    ]
    first = llm.generate([PROMPT, PROMPT], params)
    assert first[0].text in ("yes", "no") and first[0].finish_reason == "stop"
    # Again, the grammar cached: the same tokens.
    again = llm.generate([PROMPT, PROMPT], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
