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
from pdserve.coordinator.tool_call_stream import ToolCallStream, call_delta


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

            plan = body.tool_plan
            tool_streams = {c.index: ToolCallStream(plan) for c in choices}

            def render(d: ChoiceDelta) -> dict:
                finish_reason = d.finish_reason
                if plan.calls_tools:
                    stream = tool_streams[d.index]
                    delta = stream.delta(d.text, d.finish_reason is not None)
                    finish_reason = stream.finish_reason(finish_reason)
                else:
                    delta = {"content": d.text} if d.text else {}
                return {
                    **chunk,
                    "choices": [
                        {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": logprobs(d.logprobs),
                            "finish_reason": finish_reason,
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
                        **self.message(body, r.text, r.finish_reason),
                        "logprobs": logprobs(r.logprobs),
                    }
                    for r in results
                ],
                "usage": serving.usage(choices, sub.n),
            }
        )

    @staticmethod
    def message(body: ChatCompletionRequest, text: str, finish_reason: str) -> dict:
        """A choice's message and finish reason: with tools, its calls as `tool_calls`."""
        if not body.tool_plan.calls_tools:
            return {
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        content, calls = body.tool_plan.calls(text)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call_delta(i, c) for i, c in enumerate(calls)]
            for call in message["tool_calls"]:
                call.pop("index")
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return {"message": message, "finish_reason": finish_reason}

    def prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The messages through the chat template, as token ids."""
        messages = [m.template_dict() for m in body.messages]
        try:
            ids = self.serving.tokenizer.encode_chat(
                messages, body.add_generation_prompt, tools=body.tools
            )
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
