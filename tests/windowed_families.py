"""The checkpoint families whose layers attend over windows or chunks, as the parity tests of
tests/test_windowed_family_parity.py run them: one entry each, adding a family is adding one."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from conftest import random_prompts
from torch import nn

from pdserve.engine import SamplingParams


def no_sinks(layer: nn.Module) -> None:
    layer.self_attn.sinks = None


def no_clamp(layer: nn.Module) -> None:
    layer.mlp.limit = math.inf


def no_router_bias(layer: nn.Module) -> None:
    layer.mlp.router.bias.data.zero_()


def no_temperature(layer: nn.Module) -> None:
    layer.self_attn.llama4.temperature = False


def no_qk_norm(layer: nn.Module) -> None:
    layer.self_attn.llama4.l2_norm = False


def no_chunks(layer: nn.Module) -> None:
    layer.self_attn.mask = {}  # full causal attention


@dataclass(frozen=True)
class WindowedFamily:
    """How one family's parity with transformers is tested (greedy tokens, float32, on CPU)."""

    name: str  # its entry in checkpoints.FAMILIES
    new_tokens: int
    # Several windows (chunks) long; one of 64 tokens or more takes the CPU attention's SDPA
    # prefill path.
    prompt_lengths: tuple[int, ...]
    # max_num_batched_tokens whose prefill chunks end inside windows and blocks (of 4 tokens).
    prefill_chunk: int
    # (num_kv_blocks, max_num_batched_tokens): a pool too small for every sequence at once, so
    # the newest are preempted and recomputed; None: not tested.
    preemption: tuple[int, int] | None
    # What its tokens depend on, removed from every layer: without any one, every prompt's
    # tokens differ from transformers', which makes the parity a test of each.
    features: tuple[Callable[[nn.Module], None], ...] = ()
    hf_class: str = "AutoModelForCausalLM"  # the transformers class its tokens come from

    def prompts(self) -> list[list[int]]:
        return random_prompts(5, list(self.prompt_lengths))

    @property
    def greedy(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.new_tokens, temperature=0, ignore_eos=True)


WINDOWED_FAMILIES: dict[str, WindowedFamily] = {
    family.name: family
    for family in (
        # Windows of 8 alternating with full layers, sinks, YaRN, clamped experts (test_gpt_oss).
        # At TP=2 each rank holds 2 of the 4 query heads and their sinks, 1 of the 2 KV heads, 24
        # of every expert's 48 columns; the first rank adds the down projections' biases.
        WindowedFamily(
            "gpt_oss",
            new_tokens=32,
            prompt_lengths=(3, 11, 29, 70),
            prefill_chunk=13,
            preemption=(48, 16),
            features=(no_sinks, no_clamp, no_router_bias),
        ),
        # Chunks of 8 on 3 rotary layers, a NoPE layer with a temperature (test_llama4). At TP=2
        # each rank holds 2 of the 4 query heads, 1 of the 2 KV heads, 48 of the dense layers' 96
        # columns, 24 of every expert's and of the shared expert's 48; the router whole on both.
        WindowedFamily(
            "llama4_text",
            new_tokens=32,
            prompt_lengths=(3, 11, 29, 70),
            prefill_chunk=13,
            preemption=(48, 16),
            features=(no_temperature, no_qk_norm, no_chunks),
        ),
        # 5 sliding layers (window 8) to 1 full, two rope bases, sandwich norms (test_gemma3).
        WindowedFamily(
            "gemma3_text",
            new_tokens=24,
            prompt_lengths=(3, 13, 30, 70),
            prefill_chunk=11,
            preemption=(80, 16),
            hf_class="Gemma3ForCausalLM",
        ),
        # One full layer and two with a 12-token window: three KV groups.
        WindowedFamily(
            "qwen2_sliding",
            new_tokens=40,
            prompt_lengths=(3, 13, 30, 57, 150),
            prefill_chunk=17,
            preemption=(80, 32),
        ),
        # Every layer windowed (12 tokens): one KV group.
        WindowedFamily(
            "mistral_sliding",
            new_tokens=40,
            prompt_lengths=(3, 13, 30, 57, 150),
            prefill_chunk=17,
            preemption=None,
        ),
    )
}
