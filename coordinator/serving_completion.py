"""`POST /v1/completions`: prompts as text or token ids, n choices each, whole or streamed, with
logprobs in the legacy completions format."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.coordinator.access_log import name_request
from pdserve.coordinator.choice_stream import ChoiceDelta, TokenLogprob
from pdserve.coordinator.openai_protocol import CompletionRequest, bad_request
from pdserve.coordinator.serving import OpenAIServing

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions (chat's is the rest of the context)


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_completion(self, request: Request) -> Response:
        serving = self.serving
        body = await serving.parse(request, CompletionRequest)
        request_id = name_request("cmpl")
        prompts = self.prompts(body)
        sub = serving.submission(
            body, prompts, body.max_tokens, DEFAULT_MAX_TOKENS, body.logprobs, "prompt"
        )
        choices = await serving.submit(request_id, sub)
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": serving.response_model(body.model),
        }
        with_logprobs = body.logprobs is not None

        def choice(index: int, text: str, logprobs: list, finish_reason: str | None) -> dict:
            return {
                "index": index,
                "text": text,
                "logprobs": self.logprobs(logprobs) if with_logprobs else None,
                "finish_reason": finish_reason,
            }

        if body.stream:

            def render(d: ChoiceDelta) -> dict:
                return {**base, "choices": [choice(d.index, d.text, d.logprobs, d.finish_reason)]}

            return serving.stream(choices, sub.n, base, render, [], body.include_usage)
        results = await serving.collect(request, choices)
        return JSONResponse(
            {
                **base,
                "choices": [choice(r.index, r.text, r.logprobs, r.finish_reason) for r in results],
                "usage": serving.usage(choices, sub.n),
            }
        )

    def prompts(self, body: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt: one string, strings, token ids, or lists of token ids. An
        empty prompt (of any of these shapes) is refused, even where the tokenizer would add a
        beginning-of-sequence token to it."""
        tokenizer = self.serving.tokenizer
        p = body.prompt
        if not p or (isinstance(p, list) and any(isinstance(x, str | list) and not x for x in p)):
            raise bad_request("'prompt' must not be empty", "prompt")
        if isinstance(p, str):
            prompts = [tokenizer.encode(p)]
        elif isinstance(p[0], str):
            prompts = [tokenizer.encode(s) for s in p]
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [list(ids) for ids in p]
        return [self.serving.check_token_ids(ids, "prompt") for ids in prompts]

    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        """The legacy completions format."""
        vocab = self.serving.vocab
        top_logprobs = []
        for e in entries:
            top = {vocab.token_str(t): lp for t, lp in e.top}
            top.setdefault(vocab.token_str(e.token_id), e.logprob)
            top_logprobs.append(top)
        return {
            "tokens": [vocab.token_str(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top_logprobs,
            "text_offset": [e.text_offset for e in entries],
        }
