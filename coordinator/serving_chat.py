"""`POST /v1/chat/completions`: messages through the model's chat template, n choices, whole or
streamed as `chat.completion.chunk`s, with logprobs in the chat format; a reasoning model's
reasoning apart from its answer (`reasoning_content`), and tool calls as `tool_calls`."""

from __future__ import annotations

import time

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.coordinator.access_log import name_request
from pdserve.coordinator.chat_output import ChatOutput, ChatOutputStream, chat_output
from pdserve.coordinator.choice_stream import ChoiceDelta, TokenLogprob
from pdserve.coordinator.openai_protocol import ChatCompletionRequest, bad_request
from pdserve.coordinator.serving import OpenAIServing
from pdserve.coordinator.tool_call_stream import call_delta


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_chat_completion(self, request: Request) -> Response:
        serving = self.serving
        body = await serving.parse(request, ChatCompletionRequest)
        request_id = name_request("chatcmpl")
        prompt, prompt_text = self.prompt(body)
        reasoning = serving.reasoning_plan(prompt_text)
        requested = body.max_completion_tokens or body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sub = serving.submission(
            body, [prompt], requested, None, num_logprobs, "messages", reasoning
        )
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
            outputs = {c.index: ChatOutputStream(body.tool_plan, reasoning) for c in choices}

            def render(d: ChoiceDelta) -> dict:
                output = outputs[d.index]
                piece = output.feed(d.text, d.finish_reason is not None)
                delta: dict = {}
                if piece.reasoning and body.include_reasoning:  # (vLLM's two names for it)
                    delta["reasoning_content"] = delta["reasoning"] = piece.reasoning
                if piece.content:
                    delta["content"] = piece.content
                if piece.tool_calls:
                    delta["tool_calls"] = piece.tool_calls
                return {
                    **chunk,
                    "choices": [
                        {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": logprobs(d.logprobs),
                            "finish_reason": output.finish_reason(d.finish_reason),
                        }
                    ],
                }

            return serving.stream(
                choices, sub.n, chunk, render, head, body.include_usage, reasoning
            )
        results = await serving.collect(request, choices)
        return JSONResponse(
            {
                **base,
                "choices": [
                    {
                        "index": r.index,
                        **self.message(
                            chat_output(r.text, r.finish_reason, body.tool_plan, reasoning),
                            body.include_reasoning,
                        ),
                        "logprobs": logprobs(r.logprobs),
                    }
                    for r in results
                ],
                "usage": serving.usage(choices, sub.n, reasoning),
            }
        )

    @staticmethod
    def message(output: ChatOutput, include_reasoning: bool = True) -> dict:
        """A choice's message and finish reason: its reasoning as `reasoning_content` (and
        `reasoning`), its calls as `tool_calls`."""
        message: dict = {"role": "assistant", "content": output.content}
        if output.reasoning is not None and include_reasoning:
            message["reasoning_content"] = message["reasoning"] = output.reasoning
        if output.calls:
            message["tool_calls"] = [call_delta(i, c) for i, c in enumerate(output.calls)]
            for call in message["tool_calls"]:
                call.pop("index")
        return {"message": message, "finish_reason": output.finish_reason}

    def prompt(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        """The messages through the chat template, as token ids and as text."""
        messages = [m.template_dict() for m in body.messages]
        tokenizer = self.serving.tokenizer
        try:
            text = tokenizer.render_chat(
                messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise bad_request(f"the chat template failed: {exc}", "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        return self.serving.check_token_ids(ids, "messages"), text

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
