"""The training corpus of `pdserve-stories`, generated from the story grammar by a seed: stories,
and chat turns written in the model's chat template, in a fixed order.

    python -m pdserve.engine.stories.corpus --out stories.txt --megabytes 8   # look at it
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path

from pdserve.engine.stories.grammar import chat_turn, story

BOS, EOS = "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_SHARE = 0.3  # of documents


def chat(question: str, answer: str) -> str:
    """A chat turn as the chat template renders it, the answer closed by <|im_end|>."""
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def documents(seed: int) -> Iterator[str]:
    """Endless documents (a story, or a chat turn), the same ones for the same seed."""
    rng = random.Random(seed)
    while True:
        yield chat(*chat_turn(rng)) if rng.random() < CHAT_SHARE else story(rng)


def corpus(seed: int, num_bytes: int) -> list[str]:
    """The first documents of the seed's stream, about num_bytes of text."""
    out, size = [], 0
    for doc in documents(seed):
        out.append(doc)
        size += len(doc) + 1
        if size >= num_bytes:
            return out
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--megabytes", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    docs = corpus(args.seed, int(args.megabytes * 1e6))
    args.out.write_text("\n".join(docs) + "\n")
    print(f"{len(docs)} documents, {args.out.stat().st_size / 1e6:.1f} MB -> {args.out}")


if __name__ == "__main__":
    main()
