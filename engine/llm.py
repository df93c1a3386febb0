"""The offline API: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pdserve.cluster.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict]


class LLM:
    """`LLM(model, tensor_parallel_size=N)` splits the model over N devices (processes)."""

    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Prompts as strings or token-id lists; one params for all or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        order: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, ids, p)
            order[request_id] = i
        results: list[CompletionOutput | None] = [None] * len(prompts)
        seqs = {rid: self.engine.seqs[rid] for rid in order}
        while self.engine.has_unfinished():
            self.engine.step()
        for seq in seqs.values():
            if seq.constraint is not None and seq.constraint.error is not None:
                raise ValueError(f"prompt {order[seq.request_id]}: {seq.constraint.error}")
        for rid, seq in seqs.items():
            results[order[rid]] = CompletionOutput(
                prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                token_ids=seq.output_token_ids,
                text=self.tokenizer.decode(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                logprobs=seq.output_logprobs,
            )
        return results  # type: ignore[return-value]
