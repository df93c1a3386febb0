"""The training corpus of `pdserve-stories`, generated from the story grammar by a seed: stories,
and conversations rendered by the model's own chat template (tool calls and tool results
included), in a fixed order.

    python -m pdserve.bench.stories.corpus --out stories.txt --megabytes 8   # look at it
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from pdserve.bench.stories.grammar import chat_turn, conversation, reasoned_conversation, story
from pdserve.engine.tokenizer import chat_template_environment

BOS, EOS = "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
# Added by the run that taught reasoning: one token each, as Qwen3's, and not special (so text
# decoded without special tokens keeps them, for a reasoning parser to split at).
THINK, END_THINK = "<think>", "</think>"
THINKING_TOKENS = [THINK, END_THINK]
# Offered tools open the text as a system turn naming each function and its parameters (a model
# of this size needs no more); an assistant's tool calls are hermes blocks (`--tool-call-parser
# hermes` reads them back); a tool's result is a turn of role "tool". The assistant's turn opens
# with its reasoning in <think> ... </think>, as Qwen3's: the generation prompt opens the block,
# and closes it empty unless `enable_thinking` is true (thinking is off unless asked); a past
# assistant turn renders its content alone (no block: its reasoning is not shown, as Qwen3's
# template drops it), so conversations render as they did before the model learned to think.
# A prompt opens with <s>, as every training document does (the corpus renders without it: the
# tokenizer adds it to each document).
CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% if tools %}{{ '<|im_start|>system\nTools:' }}"
    "{% for tool in tools %}{% set f = tool.function or tool %}"
    "{{ ' ' + f.name + '(' + (f.parameters.properties or {}) | join(', ') + ')' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '<tool_call>\n' }}"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "{{ '\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}"
    "{% if not enable_thinking %}{{ '\n</think>\n\n' }}{% endif %}{% endif %}"
)
CHAT_SHARE = 0.3  # of documents
TOOLS_CHAT_SHARE = 0.5  # of documents, in the corpus with tools
THINK_CHAT_SHARE = 0.6  # of documents, in the corpus with thinking (its new turns need the room)


@cache
def _template():  # noqa: ANN202
    return chat_template_environment().from_string(CHAT_TEMPLATE)


def render(messages: list[dict], tools: tuple[dict, ...] = ()) -> str:
    """A conversation as the chat template renders it (as history), its last turn closed by
    <|im_end|>."""
    return _template().render(messages=messages, tools=list(tools), add_generation_prompt=False)


def generation_prompt(
    messages: list[dict], tools: tuple[dict, ...] = (), thinking: bool = False
) -> str:
    """A conversation and the opening of the assistant's turn, thinking on or off."""
    return _template().render(
        messages=messages, tools=list(tools), add_generation_prompt=True, enable_thinking=thinking
    )


def reply(messages: list[dict], tools: tuple[dict, ...] = (), reasoning: str | None = None) -> str:
    """A conversation whose last turn is the assistant's, as the model writes it after the
    generation prompt: its reasoning (thinking on) or the empty block (off), then its answer."""
    prompt = generation_prompt(messages[:-1], tools, thinking=reasoning is not None)
    head = render(messages[:-1], tools)
    last = render(messages, tools)[len(head) :].removeprefix(IM_START + "assistant\n")
    return prompt + (f"{reasoning}\n{END_THINK}\n\n" if reasoning is not None else "") + last


def chat(question: str, answer: str) -> str:
    """One question and its answer, rendered."""
    return render([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])


# The corpora: stories and chat turns (what pdserve-stories first learned), and the same with
# conversations that offer the tool, call it and answer from its result, and JSON answers; and
# those again, half of them reasoning before their last turn and the rest not.
CORPORA = ("stories", "stories+tools", "stories+tools+think")


def documents(seed: int, kind: str = "stories") -> Iterator[str]:
    """Endless documents (a story, or a conversation), the same ones for the same seed."""
    rng = random.Random(seed)
    share = {"stories": CHAT_SHARE, "stories+tools": TOOLS_CHAT_SHARE}.get(kind, THINK_CHAT_SHARE)
    while True:
        if rng.random() >= share:
            yield story(rng)
        elif kind == "stories":
            yield chat(*chat_turn(rng))
        elif kind == "stories+tools":
            yield render(*conversation(rng))
        else:
            yield reply(*reasoned_conversation(rng))


def corpus(seed: int, num_bytes: int, kind: str = "stories") -> list[str]:
    """The first documents of the seed's stream, about num_bytes of text."""
    if kind not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {kind!r}")
    out, size = [], 0
    for doc in documents(seed, kind):
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
    p.add_argument("--corpus", choices=CORPORA, default="stories")
    args = p.parse_args(argv)
    docs = corpus(args.seed, int(args.megabytes * 1e6), args.corpus)
    args.out.write_text("\n".join(docs) + "\n")
    print(f"{len(docs)} documents, {args.out.stat().st_size / 1e6:.1f} MB -> {args.out}")


if __name__ == "__main__":
    main()
