"""Structured outputs on the engine: every output of a JSON-schema constraint validates against
the schema (random schemas from a seeded generator: objects, arrays, enums, nesting, required and
optional fields, bounded numbers, string patterns), regex, choice and EBNF outputs match their
constraint, under greedy and seeded sampling; a spec that cannot be compiled is refused with the
reason and holds nothing; a constrained sequence that is preempted gives what it gives alone."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from pdserve.cluster.structured_output import StructuredOutput
from pdserve.engine import LLM, SamplingParams

WORDS = ["cat", "dog", "red", "blue", "river", "ball"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of the kinds applications send."""
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern"]
    if depth < 2:
        kinds += ["object", "array"] * 2
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(1, 3))
        required = [n for n in names if rng.random() < 0.7]
        return {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": required,
            "additionalProperties": False,
        }
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": 1,
            "maxItems": rng.randint(1, 3),
        }
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, 3)}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[a-z]{2,5}$"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    return {"type": "boolean"}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("pdserve-stories", num_kv_blocks=512, block_size=16)


@pytest.mark.parametrize("seed", range(6))
def test_random_json_schemas_give_valid_json_greedy_and_sampled(llm, seed):
    rng = random.Random(seed)
    schema = {
        "type": "object",
        "properties": {"a": random_schema(rng), "b": random_schema(rng)},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    spec = StructuredOutput.json_schema(schema)
    params = [
        SamplingParams(max_tokens=200, temperature=0, structured=spec),
        SamplingParams(max_tokens=200, temperature=0.9, seed=seed, structured=spec),
    ]
    outs = llm.generate(["Once upon a time", "Where is the cat?"], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_mode_gives_a_json_object(llm):
    """Asked in chat for JSON (which pdserve-stories learned to write), and at a plain story
    prompt, where the constraint alone makes the output JSON (a prefix of an object if it runs
    out of tokens)."""
    chat = llm.tokenizer.encode_chat([{"role": "user", "content": "Describe Tom in JSON."}])
    params = SamplingParams(
        max_tokens=120, temperature=0, structured=StructuredOutput.any_json_object()
    )
    out = llm.generate([chat], params)[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    out = llm.generate("Tell me about the cat.", params)[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and out.text.startswith("{")


def test_regex_choice_and_grammar_outputs_match_their_constraints(llm):
    specs = [
        (StructuredOutput(kind="regex", spec=r"[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}"),
        (StructuredOutput(kind="choice", choices=["cat", "dog", "the red bird"]), None),
        (
            StructuredOutput(kind="grammar", spec='root ::= ("yes" | "no") "." " " ("yes" | "no")'),
            r"(yes|no)\. (yes|no)",
        ),
    ]
    for spec, pattern in specs:
        for params in (
            SamplingParams(max_tokens=40, temperature=0, structured=spec),
            SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured=spec),
        ):
            out = llm.generate("Once upon a time", params)[0]
            assert out.finish_reason == "stop"
            if spec.kind == "choice":
                assert out.text in spec.choices
            else:
                assert re.fullmatch(pattern, out.text), out.text


def test_an_output_the_constraint_cannot_finish_in_max_tokens_ends_with_length(llm):
    spec = StructuredOutput(kind="regex", spec="[a-z]{50}")
    out = llm.generate("Once", SamplingParams(max_tokens=3, temperature=0, structured=spec))[0]
    assert out.finish_reason == "length" and re.fullmatch("[a-z]*", out.text)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: StructuredOutput(kind="choice", choices=[]), "at least one choice"),
        (lambda: StructuredOutput(kind="regex", spec="(a"), "does not compile"),
        (lambda: StructuredOutput(kind="json", spec="{not json"), "not JSON"),
        (lambda: StructuredOutput(kind="json", spec="[1]"), "is an object"),
        (lambda: StructuredOutput(kind="yaml", spec="x"), "must be one of"),
        # Keywords the compiler takes without enforcing them: refused, named.
        (
            lambda: StructuredOutput.json_schema({"type": "array", "uniqueItems": True}),
            "uniqueItems",
        ),
        (lambda: StructuredOutput.json_schema({"properties": {"a": {"not": {}}}}), "'not'"),
        (lambda: StructuredOutput.json_schema({"$ref": "http://example.com/s"}), "remote"),
    ],
)
def test_a_bad_spec_is_refused_when_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_spec_the_compiler_cannot_take_is_refused_naming_why_and_holds_nothing(llm):
    bm = llm.engine.block_manager
    bad = [
        (
            StructuredOutput.json_schema(
                {"type": "object", "properties": {"a": {"type": "strin"}}}
            ),
            "strin",
        ),
        (StructuredOutput(kind="grammar", spec="root ::= oops"), "oops"),
    ]
    for spec, named in bad:
        with pytest.raises(ValueError, match=named):
            llm.generate("Once", SamplingParams(max_tokens=8, structured=spec))
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.seqs
    # The engine goes on serving.
    assert llm.generate("Once", SamplingParams(max_tokens=4, temperature=0))[0].token_ids


def test_a_grammar_is_compiled_once_per_spec():
    llm = LLM("pdserve-stories", num_kv_blocks=128, block_size=16)
    spec = StructuredOutput(kind="choice", choices=["yes", "no"])
    params = SamplingParams(max_tokens=4, temperature=0, structured=spec)
    llm.generate(["a", "b", "c"], params)
    llm.generate("d", params)
    assert (llm.engine.grammars.misses, llm.engine.grammars.hits) == (1, 3)


@pytest.mark.parametrize("after_period", [False, True])
def test_a_preempted_constrained_sequence_gives_what_it_gives_alone(after_period):
    """Also with the constraint past a marker (a reasoning model's), found again in the outputs
    of a sequence recomputed after preemption."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "things": {"type": "array", "items": {"enum": WORDS}, "maxItems": 6},
        },
        "required": ["name", "things"],
        "additionalProperties": False,
    }
    spec = StructuredOutput.json_schema(schema)
    roomy = LLM("pdserve-stories", num_kv_blocks=256, block_size=4)
    period = roomy.tokenizer.encode(".", add_special_tokens=False)
    if after_period:
        spec = StructuredOutput(kind="json", spec=spec.spec, after=period)
    prompts = [f"Once upon a time there was a cat number {i}." for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=1, structured=spec)
    alone = [roomy.generate(p, params)[0].token_ids for p in prompts]
    tight = LLM("pdserve-stories", num_kv_blocks=40, block_size=4)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    marked = 0
    for out in outs:
        tokens = out.token_ids
        if after_period:
            if period[0] not in tokens:
                continue
            tokens = tokens[tokens.index(period[0]) + 1 :]
            marked += 1
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(roomy.tokenizer.decode(tokens)), schema)
    assert marked >= 2 or not after_period


def test_forced_tokens_give_the_same_outputs_in_fewer_steps():
    """Where the grammar allows one token alone (a strict schema's keys and punctuation), the
    engine appends it without a step: the same tokens, greedy and seeded, in fewer steps."""
    schema = {
        "type": "object",
        "properties": {
            "character": {"enum": ["the little cat", "the big brown dog"]},
            "things": {"type": "array", "items": {"enum": WORDS}, "maxItems": 3},
            "happy": {"type": "boolean"},
        },
        "required": ["character", "things", "happy"],
        "additionalProperties": False,
    }
    spec = StructuredOutput.json_schema(schema)
    prompts = ["Once upon a time", "Where is the cat?", "Tom and Lily"]
    params = [
        SamplingParams(max_tokens=80, temperature=0, structured=spec),
        SamplingParams(max_tokens=80, temperature=0.9, seed=4, structured=spec),
    ]
    runs = {}
    for forced in (False, True):
        llm = LLM("pdserve-stories", num_kv_blocks=256, block_size=16, forced_tokens=forced)
        outs = [o for p in params for o in llm.generate(prompts, p)]
        runs[forced] = ([o.token_ids for o in outs], llm.engine.stats)
        for out in outs:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), schema)
    (tokens_off, off), (tokens_on, on) = runs[False], runs[True]
    assert tokens_on == tokens_off
    assert off.num_forced_tokens == 0 and on.num_forced_tokens > 0
    assert on.num_steps < off.num_steps


def test_forced_tokens_are_not_appended_for_a_request_with_logprobs():
    spec = StructuredOutput(kind="choice", choices=["the little cat", "the big brown dog"])
    llm = LLM("pdserve-stories", num_kv_blocks=64, block_size=16, forced_tokens=True)
    out = llm.generate(
        "Once upon a time",
        SamplingParams(max_tokens=20, temperature=0, logprobs=0, structured=spec),
    )[0]
    assert out.text in spec.choices
    assert llm.engine.stats.num_forced_tokens == 0
    assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_a_constraint_after_a_marker_leaves_the_text_before_it_free(llm, temperature):
    """A reasoning model's constraint begins past its end-of-reasoning tokens (`after`): here
    the first period. Up to it the output is what it is unconstrained (greedy, and sampled with a
    seed); past it, it is JSON that validates."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    period = llm.tokenizer.encode(".", add_special_tokens=False)
    assert len(period) == 1
    spec = StructuredOutput(kind="json", spec=json.dumps(schema), after=period)
    prompts = ["Once upon a time there was a cat.", "Lily had a red ball."]
    free = SamplingParams(max_tokens=60, temperature=temperature, seed=3)
    constrained = free.replace(max_tokens=120, structured=spec)
    for prompt in prompts:
        unconstrained = llm.generate(prompt, free)[0].token_ids
        out = llm.generate(prompt, constrained)[0]
        cut = out.token_ids.index(period[0]) + 1
        assert out.token_ids[:cut] == unconstrained[:cut]
        assert not llm.tokenizer.decode(out.token_ids[:cut]).lstrip().startswith("{")
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(llm.tokenizer.decode(out.token_ids[cut:])), schema)


def test_a_constraint_whose_marker_never_comes_never_applies(llm):
    spec = StructuredOutput(
        kind="json", spec='{"type": "object"}', after=[llm.tokenizer.vocab_size - 1]
    )
    params = SamplingParams(max_tokens=30, temperature=0)
    want = llm.generate("Once upon a time", params)[0].token_ids
    assert llm.generate("Once upon a time", params.replace(structured=spec))[0].token_ids == want
