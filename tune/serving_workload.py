"""What the load generator sends: one `RequestSpec` (prompt, prompt length, output length) per
request, from a seeded synthetic mix of short and long prompts or from a ShareGPT-format file."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Plain words for text prompts; one word is one or two tokens for most tokenizers.
WORDS = (
    "the model reads a prompt and writes tokens one at a time while the server batches many "
    "requests together so that every step of the decoder serves all of them at once and the "
    "cache of keys and values grows by one entry per token for each running sequence"
).split()


@dataclass(slots=True, frozen=True)
class RequestSpec:
    prompt: str | list[int]  # text, or token ids (the completions API takes either)
    prompt_len: int  # tokens, as the workload intends them
    output_len: int  # max_tokens, generated in full with ignore_eos
    kind: str = "short"  # which part of the mix it came from


@dataclass(slots=True)
class SyntheticWorkload:
    """Mostly short prompts with short decodes, and `long_fraction` of long prompts (with short
    decodes) placed at seeded random positions in the stream. Lengths are uniform in [lo, hi]."""

    short_prompt_len: tuple[int, int] = (16, 64)
    short_output_len: tuple[int, int] = (64, 128)
    long_fraction: float = 0.0
    long_prompt_len: tuple[int, int] = (1536, 1900)
    long_output_len: tuple[int, int] = (8, 16)
    prompt_format: str = "tokens"  # tokens: random token ids; text: random words
    token_id_range: tuple[int, int] = (10, 500)  # ids drawn from [lo, hi): valid in any vocab >= hi

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.prompt_format not in ("tokens", "text"):
            raise ValueError(f"prompt_format must be tokens or text, got {self.prompt_format!r}")
        for name in ("short_prompt_len", "short_output_len", "long_prompt_len", "long_output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {(lo, hi)}")

    def sample(self, num_requests: int, seed: int) -> list[RequestSpec]:
        rng = random.Random(seed)
        num_long = round(num_requests * self.long_fraction)
        long_positions = set(rng.sample(range(num_requests), num_long))
        specs = []
        for i in range(num_requests):
            kind = "long" if i in long_positions else "short"
            prompt_range, output_range = (
                (self.long_prompt_len, self.long_output_len)
                if kind == "long"
                else (self.short_prompt_len, self.short_output_len)
            )
            prompt_len = rng.randint(*prompt_range)
            output_len = rng.randint(*output_range)
            specs.append(RequestSpec(self._prompt(rng, prompt_len), prompt_len, output_len, kind))
        return specs

    def _prompt(self, rng: random.Random, length: int) -> str | list[int]:
        if self.prompt_format == "tokens":
            return [rng.randrange(*self.token_id_range) for _ in range(length)]
        return " ".join(rng.choice(WORDS) for _ in range(length))


def approximate_token_count(text: str) -> int:
    """About four characters a token, for English with a BPE tokenizer: used without a tokenizer."""
    return max(1, len(text) // 4)


def load_tokenizer(path: str | Path) -> Callable[[str], int]:
    """A token counter from a `tokenizer.json` file (or a checkpoint folder holding one)."""
    from tokenizers import Tokenizer

    path = Path(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def load_sharegpt(
    path: str | Path,
    num_requests: int,
    seed: int,
    count_tokens: Callable[[str], int] = approximate_token_count,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    min_len: int = 4,
) -> list[RequestSpec]:
    """The first human turn of each conversation as the prompt, the reply's length as the output
    length; conversations too short or too long are skipped, the rest drawn in seeded order."""
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    specs: list[RequestSpec] = []
    for i in order:
        turns = data[i].get("conversations") or data[i].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        prompt_len, output_len = count_tokens(prompt), count_tokens(reply)
        if prompt_len < min_len or output_len < min_len:
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        specs.append(RequestSpec(prompt, prompt_len, output_len, "sharegpt"))
        if len(specs) == num_requests:
            break
    if len(specs) < num_requests:
        raise ValueError(f"{path}: only {len(specs)} usable conversations, {num_requests} wanted")
    return specs
