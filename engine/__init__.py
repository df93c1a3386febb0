"""What every node runs: the model, the paged KV pool, scheduling, sampling, the offline API.

`LLM` and `CompletionOutput` load on first use, so importing a light part of the engine (its
config, tokenizer or block manager) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM, CompletionOutput

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name in ("LLM", "CompletionOutput"):
        from pdserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
