"""Tokenizer of a checkpoint: `tokenizer.json` through the `tokenizers` library, the chat template
of `tokenizer_config.json` (or one given instead) rendered with jinja2, and the end-of-sequence
ids."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_content(value: object) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # As Hugging Face's templates expect it: plain JSON, not jinja2's HTML-escaped kind.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """Where chat templates render: sandboxed, with the whitespace rules, the `tojson` filter and
    the `raise_exception` function that Hugging Face's templates are written for."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """chat_template: a Jinja template to use instead of tokenizer_config.json's."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = chat_template or cfg.get("chat_template")
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        eos: list[int] = []
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            eos += gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        if self.eos_token is not None:
            eos_id = self._tok.token_to_id(self.eos_token)
            if eos_id is not None:
                eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self._template_env = chat_template_environment()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token and its id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: object
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        template = self._template_env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """tools: the request's tools (OpenAI's format, as Hugging Face templates take them);
        template_kwargs: more variables for the template (`enable_thinking`)."""
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        # The rendered template usually carries its special tokens already.
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The messages through the chat template, as text."""
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return self.apply_chat_template(messages, add_generation_prompt, **extra)
