"""Shared fixtures: a private model cache and cluster key set, tiny checkpoints per family, and
their HF outputs."""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# `make test-compiled` runs the parity tests with the compiled model step: every engine they make
# gets compile=True (a CPU without a C++ compiler runs them eagerly, saying so in the log).
COMPILE = os.environ.get("PDSERVE_TEST_COMPILE") == "1"


@pytest.fixture
def steps_really_compiled(caplog: pytest.LogCaptureFixture):
    """Under `make test-compiled`: fails the test whose engines' compiled steps fell back to
    eager (each fallback is a "compile: failed" warning), so that eager tokens cannot pass for
    compiled ones."""
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        yield
    if COMPILE:
        records = caplog.get_records("setup") + caplog.get_records("call")
        failed = [r.getMessage() for r in records if "compile: failed" in r.getMessage()]
        assert not failed, f"the compiled step ran eagerly: {failed[0]}"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker runs on its own share of the host's cores, and the engines
    and nodes it starts (which take the cores they may use, `engine.cpu.threads`) run there too:
    two workers whose OpenMP threads spin on the same cores slow each other down many times over.
    A test that needs the whole host reads `host_cores()`."""
    from worker_cores import pin_this_worker

    pin_this_worker()


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # pdserve-tiny is generated once per test session, never read from a user's cache.
    if "PDSERVE_CACHE" not in os.environ:
        os.environ["PDSERVE_CACHE"] = str(tmp_path_factory.mktemp("pdserve-cache"))
    # The cluster key set `serve` makes on first use, and clients read: this session's own.
    if "PDSERVE_CLUSTER_KEYS" not in os.environ:
        os.environ["PDSERVE_CLUSTER_KEYS"] = str(tmp_path_factory.mktemp("pdserve") / "keys")
    # The suite runs on the small random pdserve-tiny unless a test names another model (the
    # stories tests name pdserve-stories): node processes inherit this.
    os.environ["PDSERVE_MODEL"] = "pdserve-tiny"


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint_dir(family) -> a tiny checkpoint of that family, built once per session."""
    from checkpoints import build_checkpoint

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_checkpoint(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def random_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


class RecordingLink:
    """Stands in for a node's coordinator link in single-node tests: keeps what the node sends."""

    def __init__(self, node_id: str = "node-under-test") -> None:
        self.node_id = node_id
        self.sent: list = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)


# Parity runs of the checkpoint families (test_moe_models.py, test_mla_models.py): transformers'
# greedy tokens for four prompts, made once per module.
FAMILY_NEW_TOKENS = 24
FAMILY_PROMPT_LENGTHS = [3, 16, 29, 50]


@pytest.fixture(scope="module")
def family_run(checkpoint_dir):
    """family -> (model dir, prompts, transformers' greedy tokens)."""
    from checkpoints import hf_greedy

    cache = {}

    def get(family: str):
        if family not in cache:
            model_dir = checkpoint_dir(family)
            prompts = random_prompts(1, FAMILY_PROMPT_LENGTHS)
            cache[family] = (model_dir, prompts, hf_greedy(model_dir, prompts, FAMILY_NEW_TOKENS))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def windowed_reference(checkpoint_dir):
    """family -> (model dir, prompts, transformers' greedy tokens) of a windowed family
    (tests/windowed_families.py), made once per session: its parity tests and its own file's
    tests share them."""
    from checkpoints import hf_greedy
    from windowed_families import WINDOWED_FAMILIES

    cache = {}

    def get(name: str):
        if name not in cache:
            family = WINDOWED_FAMILIES[name]
            model_dir = checkpoint_dir(name)
            prompts = family.prompts()
            expected = hf_greedy(model_dir, prompts, family.new_tokens, family.hf_class)
            cache[name] = (model_dir, prompts, expected)
        return cache[name]

    return get
