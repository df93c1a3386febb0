"""pdserve-stories reads: continuations of 20 story openings are token-identical through the
offline engine, a disaggregated cluster (a KV handoff over tcp between two processes) and a
colocated worker, the same text comes out of `pdserve serve`'s HTTP API with no model named, and
the story grammar accepts their sentences: at least 95% greedy, at least 80% at temperature 0.7
with seeds. A failure prints every sentence the grammar refused."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import regex
from local_cluster import Cluster
from serve_process import ServeProcess

from pdserve.bench.stories.recognizer import Reading, _patterns, canonical, read
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.client import CoordinatorClient
from pdserve.engine import LLM
from pdserve.engine.embedded.catalog import STORIES

pytestmark = pytest.mark.cluster

OPENINGS = [
    "Once upon a time",
    "Once upon a time, there was a little",
    "There was once a brave",
    "There was once a shy bunny named Ben.",
    "Once upon a time, a curious cat named Leo lived near the",
    "Once upon a time, there was a kind girl named Lily. Lily liked to",
    "There was once a big dog named Tom. Every day, Tom went to the",
    "Once upon a time, there was a happy bird named Mia. One morning, Mia saw a",
    "There was once a funny cat named Ben. Ben had a red",
    "Once upon a time, a friendly duck named Zoe lived near the park. One day, Zoe found a",
    "There was once a small mouse named Jack. He liked his",
    "Once upon a time, there was a brave dog named Sam. He loved to",
    "There was once a curious girl named Amy. She loved to play with her friends. One day,",
    "Once upon a time, there was a little frog named Finn. Finn had a blue ball. Then Finn met a",
    'There was once a kind bear named Rose. Rose had a green kite. "Can I play with your',
    "Once upon a time, there was a happy puppy named Max. Max had a yellow drum. But then the",
    "There was once a big cat named Emma. Emma had a soft hat. Suddenly, the wind",
    "Once upon a time, a little bunny named Kim lived near the park. Kim could not find",
    "There was once a shy boy named Dan. Dan felt",
    "Once upon a time, there was a funny duck named Lucy. Lucy had a pink cup. They looked everywhere and",
]
MAX_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
CHAT_QUESTIONS = [
    "Where is the cat?",
    "What does Lily like to do?",
    "How does Tom feel?",
    "What color is the kite?",
    "Can you tell me a story?",
    "Hello!",
]


def test_every_opening_is_how_the_grammar_could_begin_a_story():
    """The openings are beginnings of stories (a story's first sentence or two, then the start of
    the next), not fragments from a story's middle the model never saw a story begin with."""
    templates = [regex.compile(p.pattern) for p in _patterns()]
    for opening in OPENINGS:
        r = read(opening)
        assert r.rejected == [], opening
        assert opening.startswith(("Once upon a time", "There was once a")), opening
        tail = canonical(r.unfinished)
        assert not tail or any(t.fullmatch(tail, partial=True) for t in templates), opening


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=1000 + i)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(STORIES, device="cpu", num_kv_blocks=512)


def prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(text) for text in OPENINGS]


def offline(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(llm), params)]


def through_cluster(
    llm: LLM, colocated: bool, greedy: list[SamplingParams], sampled: list[SamplingParams]
) -> tuple[list[list[int]], list[list[int]]]:
    async def run(addr: str) -> tuple[list, list]:
        async with CoordinatorClient(addr) as client:
            jobs = [client.complete(p, s) for p, s in zip(prompts(llm) * 2, greedy + sampled)]
            tokens = [t for t, _ in await asyncio.gather(*jobs)]
        return tokens[: len(greedy)], tokens[len(greedy) :]

    with Cluster(1, 1, colocated=colocated, model=STORIES, num_kv_blocks=512) as cluster:
        result = asyncio.run(run(cluster.client_addr))
        cluster.wait_until_idle()
    return result


def through_serve(tmp_path, greedy: list[SamplingParams], sampled: list[SamplingParams]) -> list:
    """The completions' texts from `pdserve serve` with no model named (so the default one),
    disaggregated over tcp, for each opening under each of the sampling settings."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_MODEL"}
    serve = ServeProcess([], tmp_path / "serve.txt", env)

    def body(prompt: str, p: SamplingParams) -> dict:
        return {
            "model": STORIES,
            "prompt": prompt,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "seed": p.seed,
        }

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=serve.url, timeout=300) as http:
            jobs = [
                http.post("/v1/completions", json=body(o, p))
                for o, p in zip(OPENINGS * 2, greedy + sampled)
            ]
            replies = await asyncio.gather(*jobs)
        for r in replies:
            assert r.status_code == 200, r.text
        return [r.json()["choices"][0]["text"] for r in replies]

    with serve:
        serve.wait_serving()
        return asyncio.run(run())


def reading(llm: LLM, outputs: list[list[int]]) -> Reading:
    """The grammar's reading of every opening with its continuation, pooled."""
    pooled = Reading()
    for opening, ids in zip(OPENINGS, outputs):
        r = read(opening + llm.tokenizer.decode(ids))
        pooled.accepted += r.accepted
        pooled.rejected += r.rejected
    return pooled


def assert_reads(r: Reading, share: float, what: str) -> None:
    assert r.num_sentences >= 3 * len(OPENINGS), f"{what}: only {r.num_sentences} sentences"
    refused = "\n".join(f"  {s}" for s in r.rejected)
    assert r.share >= share, (
        f"{what}: the grammar accepts {r.share:.1%} of {r.num_sentences} sentences, refusing:\n"
        f"{refused}"
    )


@pytest.mark.timeout(900)
def test_stories_are_the_same_everywhere_and_the_grammar_accepts_them(llm, tmp_path):
    greedy = [GREEDY] * len(OPENINGS)
    sampled = [seeded(i) for i in range(len(OPENINGS))]
    alone_greedy, alone_sampled = offline(llm, greedy), offline(llm, sampled)
    assert_reads(reading(llm, alone_greedy), 0.95, "greedy")
    assert_reads(reading(llm, alone_sampled), 0.80, "temperature 0.7")
    for colocated in (False, True):
        got_greedy, got_sampled = through_cluster(llm, colocated, greedy, sampled)
        where = "colocated" if colocated else "disaggregated"
        assert got_greedy == alone_greedy, f"greedy streams differ {where}"
        assert got_sampled == alone_sampled, f"seeded streams differ {where}"
    texts = [llm.tokenizer.decode(ids) for ids in alone_greedy + alone_sampled]
    assert through_serve(tmp_path, greedy, sampled) == texts, "pdserve serve's texts differ"


def test_chat_answers_read(llm):
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    outs = llm.generate(chats, SamplingParams(max_tokens=80, temperature=0))
    pooled = Reading()
    for q, out in zip(CHAT_QUESTIONS, outs):
        assert out.finish_reason == "stop", (
            f"{q!r}: no end of the answer in 80 tokens: {out.text!r}"
        )
        r = read(out.text)
        assert r.unfinished == "", f"{q!r}: {out.text!r}"
        pooled.accepted += r.accepted
        pooled.rejected += r.rejected
    assert pooled.rejected == [] and pooled.num_sentences >= len(CHAT_QUESTIONS)


@pytest.mark.parametrize(
    "args",
    [
        ["--prompt", "Once upon a time", "--max-tokens", "120"],
        ["--chat", "--prompt", "Where is the cat?"],
    ],
    ids=["story", "chat"],
)
def test_the_readme_shows_what_generate_prints(args):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_MODEL"}
    res = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"pdserve generate {' '.join(shlex.quote(a) for a in args)}" in readme.replace('"', "'")
    assert f"> {res.stdout.strip()}\n" in readme, res.stdout


@pytest.mark.timeout(600)
def test_the_training_command_repeats_the_committed_checkpoints_start(tmp_path):
    """Same seed, same corpus, same tokenizer, same batches: a fresh run's first steps (the warm-up,
    whose learning rates do not depend on the run's length) have the committed run's losses."""
    from pdserve.bench.stories.train import main as train
    from pdserve.engine.embedded.catalog import STORIES_DIR

    train(["--out", str(tmp_path), "--steps", "4", "--no-progress"])
    # The checkpoint went on, run after run, from one from scratch on the stories corpus (the
    # record of each run it went on from inside its own).
    base = json.loads((STORIES_DIR / "training.json").read_text())
    while base.get("init"):
        base = base["init"]
    fresh = json.loads((tmp_path / "training.json").read_text())
    # The same tokenizer, but for the two tokens the reasoning run added.
    committed = json.loads((STORIES_DIR / "tokenizer.json").read_text())
    committed["added_tokens"] = [
        t for t in committed["added_tokens"] if t["content"] not in ("<think>", "</think>")
    ]
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == committed
    # Options added after that run, as it ran.
    since = {"corpus": "stories", "init_from": "", "windows": "anywhere"}
    assert fresh["recipe"] | {"steps": 0} == since | base["recipe"] | {"steps": 0}
    assert fresh["losses"] == pytest.approx(base["losses"][:4], abs=1e-3)
