"""`POST /v1/chat/completions`: messages through the model's chat template, n choices, whole or
streamed as `chat.completion.chunk`s, with logprobs in the chat format."""

from __future__ import annotations

import time

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.coordinator.access_log import name_request
from pdserve.coordinator.choice_stream import ChoiceDelta, TokenLogprob
from pdserve.coordinator.openai_protocol import ChatCompletionRequest, bad_request
from pdserve.coordinator.serving import OpenAIServing


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_chat_completion(self, request: Request) -> Response:
        serving = self.serving
        body = await serving.parse(request, ChatCompletionRequest)
        request_id = name_request("chatcmpl")
        prompt = self.prompt(body)
        requested = body.max_completion_tokens or body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sub = serving.submission(body, [prompt], requested, None, num_logprobs, "messages")
        choices = await serving.submit(request_id, sub)
        base = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": serving.response_model(body.model),
        }

        def logprobs(entries: list[TokenLogprob]) -> dict | None:
            return self.logprobs(entries) if body.logprobs else None

        if body.stream:
            chunk = {**base, "object": "chat.completion.chunk"}
            head = [
                {
                    **chunk,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                for c in choices
            ]

            def render(d: ChoiceDelta) -> dict:
                delta = {"content": d.text} if d.text else {}
                return {
                    **chunk,
                    "choices": [
                        {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": logprobs(d.logprobs),
                            "finish_reason": d.finish_reason,
                        }
                    ],
                }

            return serving.stream(choices, sub.n, chunk, render, head, body.include_usage)
        results = await serving.collect(request, choices)
        return JSONResponse(
            {
                **base,
                "choices": [
                    {
                        "index": r.index,
                        "message": {"role": "assistant", "content": r.text},
                        "logprobs": logprobs(r.logprobs),
                        "finish_reason": r.finish_reason,
                    }
                    for r in results
                ],
                "usage": serving.usage(choices, sub.n),
            }
        )

    def prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The messages through the chat template, as token ids."""
        messages = [m.template_dict() for m in body.messages]
        try:
            ids = self.serving.tokenizer.encode_chat(messages, body.add_generation_prompt)
        except (jinja2.TemplateError, ValueError) as exc:
            raise bad_request(f"the chat template failed: {exc}", "messages") from None
        return self.serving.check_token_ids(ids, "messages")

    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        vocab = self.serving.vocab

        def item(token_id: int, logprob: float) -> dict:
            return {
                "token": vocab.token_str(token_id),
                "logprob": logprob,
                "bytes": list(vocab.token_bytes(token_id)),
            }

        content = [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content, "refusal": None}
