"""What every node runs: the model, the paged KV pool, scheduling, sampling, the offline API."""

from engine.llm import LLM, CompletionOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
