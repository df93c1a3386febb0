"""Structured outputs through the disaggregated path: the prefill node samples the first token
under the constraint, the decode node rebuilds its matcher from the spec over the tokens already
accepted (a constraint that begins past the end of the reasoning, as a reasoning model's does,
finds it there too), and a decode node killed mid-output or a prefill node killed after admission changes
nothing: every output is the offline engine's, and valid. A constraint no node can compile is
refused with its reason, holding no block."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import msgspec
import pytest
from local_cluster import Cluster

from pdserve.cluster.structured_output import StructuredOutput
from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import SubmitError
from pdserve.coordinator.metrics import Metrics
from pdserve.coordinator.request_state import Phase
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.cluster

MODEL = "pdserve-stories"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "bird"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
SPEC = StructuredOutput.json_schema(SCHEMA)
TOKENIZER = Tokenizer(resolve_model_dir(MODEL))
# As a reasoning model's constraint is: past the end of its reasoning, which the node that samples
# finds in the outputs, also in those another node sampled. pdserve-stories thinks when its chat
# template is asked to (the two chat prompts below).
THINK_END = TOKENIZER.encode("</think>", add_special_tokens=False)
SPEC_AFTER = msgspec.structs.replace(SPEC, after=THINK_END)
PROMPTS = [
    "Once upon a time there was a cat.",
    "Where is the dog?",
    "Tell me about the river.",
    "Lily had a red ball.",
]
THINKING = [
    TOKENIZER.encode(
        TOKENIZER.render_chat(
            [{"role": "user", "content": q}], template_kwargs={"enable_thinking": True}
        ),
        add_special_tokens=False,
    )
    for q in ("Describe Zoe in JSON.", "Where is the cat?")
]
PROMPT_IDS = [TOKENIZER.encode(p) for p in PROMPTS] + THINKING
PARAMS = [
    SamplingParams(max_tokens=80, temperature=0, structured=SPEC),
    SamplingParams(max_tokens=80, temperature=0.9, seed=7, structured=SPEC),
    SamplingParams(max_tokens=100, temperature=0.9, seed=5, structured=SPEC_AFTER),
]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, num_kv_blocks=1024, block_size=8)


def expected(offline: LLM) -> list[list[int]]:
    return [o.token_ids for p in PARAMS for o in offline.generate(PROMPT_IDS, p)]


def check_valid(offline: LLM, outputs: list[list[int]]) -> None:
    reasoned = 0
    for tokens, params in zip(outputs, [p for p in PARAMS for _ in PROMPT_IDS]):
        after = params.structured.after
        if after:  # free reasoning up to its end, JSON past it; no end: all free
            if after[0] not in tokens:
                continue
            tokens = tokens[tokens.index(after[0]) + 1 :]
            reasoned += 1
        jsonschema.validate(json.loads(offline.tokenizer.decode(tokens)), SCHEMA)
    if len(outputs) == len(PARAMS) * len(PROMPT_IDS):
        assert reasoned == len(THINKING)  # (the offline engine's outputs: holds or never does)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_constrained_outputs_through_a_handoff_equal_the_offline_engines(transport, offline):
    want = expected(offline)
    with Cluster(1, 1, transport=transport, model=MODEL) as cluster:
        got = asyncio.run(run_all_ids(cluster.client_addr, PROMPT_IDS))
        assert got == want
        check_valid(offline, got)
        cluster.wait_until_idle()


def test_forced_tokens_through_a_handoff_and_colocated_give_the_offline_engines_outputs(offline):
    """A decode node appending forced tokens reports each as a token of its own: the streams are
    the offline engine's (forced tokens off), disaggregated over tcp and colocated, and the
    nodes' counts of forced tokens reach /metrics (colocated: the offline engine's count; after a
    handoff fewer, as the prefill node forces none)."""
    want = expected(offline)
    forcing = LLM(MODEL, num_kv_blocks=1024, block_size=8, forced_tokens=True)
    assert [o.token_ids for p in PARAMS for o in forcing.generate(PROMPT_IDS, p)] == want
    offline_forced = forcing.engine.stats.num_forced_tokens
    assert offline_forced > 0
    prompt_ids = PROMPT_IDS
    for colocated in (False, True):
        with Cluster(1, 1, colocated=colocated, model=MODEL, forced_tokens=True) as cluster:
            got = asyncio.run(run_all_ids(cluster.client_addr, prompt_ids))
            assert got == want
            cluster.wait_until_idle()
            (node,) = [n for n in cluster.coordinator.nodes.alive() if n.decodes]
            if colocated:
                assert node.forced_tokens == offline_forced
            else:
                assert 0 < node.forced_tokens <= offline_forced
            text = Metrics(cluster.coordinator).render().decode()
            line = f'pdserve_forced_tokens_total{{node="{node.node_id}"}} {node.forced_tokens}.0'
            assert line in text.splitlines()


async def run_all_ids(addr: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    async with CoordinatorClient(addr) as client:
        jobs = [client.complete(ids, p) for p in PARAMS for ids in prompt_ids]
        return [tokens for tokens, _ in await asyncio.gather(*jobs)]


def test_a_decode_node_killed_mid_output_changes_nothing(offline):
    prompt_ids = PROMPT_IDS
    want = expected(offline)
    with Cluster(1, 2, model=MODEL) as cluster:

        async def run_with_kill() -> list[list[int]]:
            async with CoordinatorClient(cluster.client_addr) as client:
                jobs = [client.complete(ids, p) for p in PARAMS for ids in prompt_ids]
                tasks = [asyncio.create_task(job) for job in jobs]
                await cluster.kill_mid_output("decode-0")
                return [tokens for tokens, _ in await asyncio.gather(*tasks)]

        got = asyncio.run(run_with_kill())
        assert got == want
        check_valid(offline, got)
        cluster.wait_until_idle()


def test_a_prefill_node_killed_after_admission_changes_nothing(offline):
    # Streamed (admitted when its prefill starts) and chunked, so the kill lands mid-prefill.
    prompt = offline.tokenizer.encode("Once upon a time there was a little cat. " * 30)
    params = SamplingParams(max_tokens=80, temperature=0.7, seed=3, structured=SPEC)
    (want,) = [o.token_ids for o in offline.generate([prompt], params)]
    config = CoordinatorConfig(
        heartbeat_timeout_s=3.0, transfer_timeout_s=10.0, kv_streaming_min_prompt_tokens=64
    )
    with Cluster(2, 1, config=config, model=MODEL, max_num_batched_tokens=16) as cluster:

        async def run_with_kill() -> list[int]:
            async with CoordinatorClient(cluster.client_addr) as client:
                tokens: list[int] = []
                stream = client.generate(prompt, params, request_id="long")
                first = asyncio.ensure_future(stream.__anext__())
                deadline = time.monotonic() + 60
                state = None
                while state is None and time.monotonic() < deadline:
                    s = cluster.coordinator.core.requests.get("long")
                    if s is not None and s.prefill_node is not None and s.phase is Phase.PREFILLING:
                        state = s
                    await asyncio.sleep(0.002)
                assert state is not None, "the prefill never started"
                await asyncio.to_thread(cluster.kill, state.prefill_node)
                tokens += (await first).token_ids
                async for event in stream:
                    tokens += event.token_ids
                return tokens

        got = asyncio.run(run_with_kill())
        assert got == want
        check_valid(offline, [got])
        cluster.wait_until_idle()


def test_a_constraint_no_node_can_compile_is_refused_with_its_reason(offline):
    bad = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}})
    with Cluster(1, 1, model=MODEL) as cluster:

        async def submit() -> str:
            async with CoordinatorClient(cluster.client_addr) as client:
                with pytest.raises(SubmitError) as caught:
                    await client.complete([5, 6, 7], SamplingParams(max_tokens=8, structured=bad))
                return str(caught.value)

        assert "strin" in asyncio.run(submit())
        cluster.wait_until_idle()
        # And it serves on.
        ids = offline.tokenizer.encode(PROMPTS[0])
        assert asyncio.run(run_all_ids(cluster.client_addr, [ids]))
