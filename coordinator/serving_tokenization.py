"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt (or chat messages
through the chat template) to token ids with the count and the context limit, and back."""

from __future__ import annotations

import jinja2
from fastapi import Request

from pdserve.coordinator.openai_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    bad_request,
    load_json,
    parse_body,
)
from pdserve.coordinator.serving import OpenAIServing


class OpenAIServingTokenization:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def tokenize(self, request: Request) -> dict:
        serving = self.serving
        data = load_json(await request.body())
        # A body with messages is a chat; anything else is a prompt (vLLM tells them apart so).
        model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        body = serving.check_model(parse_body(data, model, serving.coordinator.config))
        tokenizer = serving.tokenizer
        if isinstance(body, TokenizeChatRequest):
            messages = [m.template_dict() for m in body.messages]
            try:
                ids = tokenizer.encode_chat(
                    messages,
                    body.add_generation_prompt,
                    body.add_special_tokens,
                    template_kwargs=body.chat_template_kwargs,
                )
            except (jinja2.TemplateError, ValueError) as exc:
                raise bad_request(f"the chat template failed: {exc}", "messages") from None
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": serving.coordinator.max_model_len,
            "tokens": ids,
            "token_strs": [tokenizer.id_to_token(t) for t in ids]
            if body.return_token_strs
            else None,
        }

    async def detokenize(self, request: Request) -> dict:
        serving = self.serving
        body = await serving.parse(request, DetokenizeRequest)
        vocab = serving.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        # Special tokens kept, so that /tokenize then /detokenize gives the text back.
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}
