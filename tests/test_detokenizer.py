"""Incremental detokenization and stop strings, without a server: streamed text is whole
characters at every step and adds up to the decoded output; stop strings match across chunks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.coordinator.detokenizer import REPLACEMENT, IncrementalDetokenizer, TokenVocabulary
from pdserve.coordinator.stop_strings import StopStringMatcher
from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.engine.tokenizer import Tokenizer

MULTIBYTE = "héllo wörld 日本語 🙂 naïve café"


@pytest.fixture(scope="module")
def model_dir():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detok.step(t) for t in token_ids] + [detok.flush()]


# --- detokenizer -------------------------------------------------------------------------------


def test_characters_split_across_tokens_are_emitted_whole(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    # The byte-level BPE really splits them: some single tokens are not whole characters.
    assert any(tokenizer.decode([t]) == REPLACEMENT for t in ids)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == MULTIBYTE
    for delta in deltas:
        assert REPLACEMENT not in delta
        delta.encode("utf-8")  # no lone surrogates either
    # The first byte of 日 alone emits nothing; the token completing it emits the character.
    held = [i for i, t in enumerate(ids) if tokenizer.decode([t]) == REPLACEMENT]
    assert deltas[held[0]] == ""


def test_the_last_incomplete_character_is_flushed_as_a_replacement(tokenizer):
    ids = tokenizer.encode("ok 日", add_special_tokens=False)[:-1]  # cut inside 日
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.step(t) for t in ids)
    assert text == "ok "
    assert detok.flush() == REPLACEMENT
    assert detok.text == tokenizer.decode(ids)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    ids = ids + [tokenizer.eos_token_ids[0]] + tokenizer.encode(" world", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == "Hello world"


def test_prompt_context_does_not_change_the_output_text(tokenizer):
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=True)
    out = tokenizer.encode(" jumps 日本", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tokenizer, prompt), out)) == " jumps 日本"


def test_a_prompt_ending_mid_character_keeps_its_bytes_to_itself(tokenizer):
    prompt = tokenizer.encode("日", add_special_tokens=False)[:1]  # a lone lead byte
    out = tokenizer.encode("abc", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(stream(detok, out)) == "abc"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=511), min_size=1, max_size=40))
def test_deltas_add_up_to_the_decoded_output_for_any_tokens(tokenizer, token_ids):
    deltas = stream(IncrementalDetokenizer(tokenizer), token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert not any(d.endswith(REPLACEMENT) for d in deltas[:-1])  # only the flush may


def test_token_bytes_and_strings_for_logprobs(tokenizer, model_dir):
    vocab = TokenVocabulary(tokenizer, model_dir)
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert b"".join(vocab.token_bytes(t) for t in ids) == MULTIBYTE.encode()
    partial = next(t for t in ids if tokenizer.decode([t]) == REPLACEMENT)
    assert vocab.token_str(partial).startswith("bytes:\\x")
    (hello,) = tokenizer.encode("Hello", add_special_tokens=False)[:1]
    assert vocab.token_str(hello) == tokenizer.decode([hello])
    assert vocab.token_str(tokenizer.eos_token_ids[0]) == "</s>"


# --- stop strings ------------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> str:
    out = [matcher.feed(c) for c in chunks]
    return "".join(out) + matcher.flush()


def test_a_stop_string_split_across_three_chunks_is_found():
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, ["abcS", "T", "OP and more"]) == "abc"
    assert matcher.matched == "STOP"
    assert matcher.feed("later") == ""


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    matcher = StopStringMatcher(["xyz"])  # the last 2 characters are held
    assert matcher.feed("abcx") == "ab"
    assert matcher.feed("y") == "c"
    assert matcher.feed("q") == "x"
    assert matcher.flush() == "yq"
    assert not matcher.stopped


def test_the_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    assert feed_all(matcher, ["hel", "lo wor", "ld"]) == "hel"
    assert matcher.matched == "lo w"


def test_no_stop_strings_hold_nothing_back():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == "abc"
    assert StopStringMatcher([""]).feed("abc") == "abc"


def test_a_stop_string_at_the_very_start_leaves_no_text():
    assert feed_all(StopStringMatcher(["he"]), ["h", "ello"]) == ""


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab日c ", max_size=40),
    stop=st.text(alphabet="ab日c ", min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_any_chunking_gives_the_text_cut_before_the_first_match(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    index = text.find(stop)
    assert feed_all(StopStringMatcher([stop]), chunks) == (text if index < 0 else text[:index])


def test_stop_string_on_multibyte_text_from_tokens(tokenizer):
    ids = tokenizer.encode("say 日本語 please", add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher(["本語"])
    out = []
    for t in ids:
        out.append(matcher.feed(detok.step(t)))
        if matcher.stopped:
            break
    assert "".join(out) == "say 日"
    assert matcher.stopped


def test_random_streams_of_tokens_with_a_stop_string_match_the_cut_decoded_text(tokenizer):
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(4, 512) for _ in range(30)]
        full = tokenizer.decode(ids)
        stop = full[10:12] if len(full) > 12 else "zz"
        detok, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher([stop])
        out = "".join(matcher.feed(detok.step(t)) for t in ids)
        out += matcher.feed(detok.flush()) + matcher.flush()
        index = full.find(stop)
        assert out == (full if index < 0 else full[:index])
