"""The story grammar and its recognizer, without a model: everything the grammar generates is
accepted, near misses are not, the corpus is a function of its seed. And the training script: its
model (the engine's layers) computes transformers' Llama on the weights it saves, every weight of
it learns, and a short run writes a checkpoint that `transformers` and pdserve read as the model
it trained."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pdserve.bench.stories import grammar
from pdserve.bench.stories.corpus import CHAT_TEMPLATE, corpus, generation_prompt, render, reply
from pdserve.bench.stories.recognizer import (
    accepts,
    accepts_answer,
    accepts_call,
    read,
    read_thinking,
    split_sentences,
    tool_calls,
)


def conversation_text(rng: random.Random) -> str:
    """The sentences of a conversation: its messages' text, not calls, results or JSON."""
    messages, _ = grammar.conversation(rng)
    return " ".join(
        m["content"]
        for m in messages
        if m["role"] in ("user", "assistant") and not m["content"].startswith(("{", "<"))
    )


def test_every_sentence_the_grammar_generates_is_accepted():
    rng = random.Random(5)
    texts = [grammar.story(rng) for _ in range(400)]
    texts += [" ".join(grammar.chat_turn(rng)) for _ in range(400)]
    texts += [conversation_text(rng) for _ in range(400)]
    rejected = [s for t in texts for s in read(t).rejected]
    assert not rejected, rejected[:5]
    assert sum(read(t).num_sentences for t in texts) > 5000


def test_every_template_is_generated():
    rng = random.Random(6)
    seen = set()
    for _ in range(3000):
        text = grammar.story(rng) + " " + " ".join(grammar.chat_turn(rng))
        text += " " + conversation_text(rng)
        seen.update(split_sentences(text)[0])
    for template in grammar.TEMPLATES:
        pattern = template.split("{")[0].lstrip('"')[:12]
        assert any(pattern.lower() in s.lower() for s in seen), template


@pytest.mark.parametrize(
    "sentence",
    [
        "One day, Tom went to the.",  # a slot left empty
        "One day, went Tom to the park.",  # words out of order
        "One day, Tom went to the moon.",  # a word no class holds
        "once upon a time, there was a little cat named Lily.",  # not capitalized
        "Once upon a time, there was a little cat named lily.",  # a name in lower case
        "Once upon a time, there was a little cat named Lily",  # no full stop
        '"Can I play with your ball?" asked.',  # nobody asks
        "Tom Tom Tom Tom.",
        "",
    ],
)
def test_near_misses_are_rejected(sentence):
    assert not accepts(sentence)


def test_sentences_split_at_their_ends_not_inside_quotes():
    text = 'One day, Tom went to the park. "Hello, Lily!" said Tom. "Can I play?" asked Lily. Then'
    sentences, rest = split_sentences(text)
    assert sentences == [
        "One day, Tom went to the park.",
        '"Hello, Lily!" said Tom.',
        '"Can I play?" asked Lily.',
    ]
    assert rest == "Then"
    reading = read(text)
    assert reading.accepted == sentences[:2] and reading.rejected == sentences[2:]
    assert reading.share == 2 / 3


def test_the_tool_calls_the_grammar_makes_are_accepted_and_near_misses_are_not():
    rng = random.Random(7)
    calls = []
    for _ in range(200):
        messages, tools = grammar.conversation(rng)
        for m in messages:
            for call in m.get("tool_calls", []):
                calls.append(call["function"])
                assert tools == grammar.TOOLS
    assert len(calls) > 30 and all(accepts_call(c) for c in calls)
    text = '<tool_call>\n{"name": "where_is", "arguments": {"character": "fox"}}\n</tool_call>'
    assert tool_calls(text) == [{"name": "where_is", "arguments": {"character": "fox"}}]
    assert accepts_call(tool_calls(text)[0])
    for near_miss in [
        {"name": "where_is", "arguments": {"character": "moon"}},  # not of the story world
        {"name": "where_is", "arguments": {"who": "fox"}},  # not its parameter
        {"name": "where_is", "arguments": {"character": "fox", "when": "now"}},
        {"name": "find", "arguments": {"character": "fox"}},  # no such tool
        {"name": "where_is"},
        None,  # a block that is not JSON
    ]:
        assert not accepts_call(near_miss), near_miss
    assert tool_calls("<tool_call>\n{not json}\n</tool_call>") == [None]


def test_the_server_renders_a_tool_conversation_as_the_corpus_wrote_it():
    """What a client sends (arguments as JSON text, the tool offered) reaches the chat template
    as the training corpus rendered it: the model sees at serving what it learned from."""
    from pdserve.coordinator.openai_protocol import ChatMessage
    from pdserve.engine.embedded.catalog import STORIES_DIR
    from pdserve.engine.tokenizer import Tokenizer

    rng = random.Random(8)
    messages = grammar.tool_turn(rng)
    wire = json.loads(json.dumps(messages))
    for m in wire:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    sent = [ChatMessage.model_validate(m).template_dict() for m in wire]
    tok = Tokenizer(STORIES_DIR, chat_template=CHAT_TEMPLATE)
    tools = list(grammar.TOOLS)
    served = tok.apply_chat_template(sent, add_generation_prompt=False, tools=tools)
    # It opens with <s>, which the tokenizer adds to each document of the corpus.
    assert served == "<s>" + render(messages, grammar.TOOLS)
    assert "Tools: where_is(character)" in served and "<tool_call>" in served
    # The prompt of each assistant turn, thinking off or on, is where the corpus' document of
    # that turn goes on with what the model writes: the call, or the sentence from the result.
    for turn in (2, 4):
        for reasoning in (None, "I need where_is for Tom."):
            doc = "<s>" + reply(messages[:turn], grammar.TOOLS, reasoning)
            prompt = tok.apply_chat_template(
                sent[: turn - 1], tools=tools, enable_thinking=reasoning is not None
            )
            assert doc.startswith(prompt), (turn, reasoning)
            written = doc[len(prompt) :]
            if reasoning is not None:
                assert written.startswith(reasoning + "\n</think>\n\n")
            assert written.endswith("<|im_end|>\n")
            assert ("<tool_call>" in written) == (turn == 2)


def test_the_generation_prompt_opens_the_think_block_and_closes_it_unless_thinking_is_on():
    """Qwen3's `enable_thinking` convention, but off unless asked: undefined or false, an empty
    closed block; true, an open one. Past assistant turns show their content alone. The prompt
    opens with <s>, one token, as the tokenizer opens every document of the corpus."""
    from pdserve.engine.embedded.catalog import STORIES_DIR
    from pdserve.engine.tokenizer import Tokenizer

    tok = Tokenizer(STORIES_DIR)
    assert tok.chat_template == CHAT_TEMPLATE
    hi = [{"role": "user", "content": "Hello!"}]
    off = "<s><|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(hi) == off
    assert tok.apply_chat_template(hi, enable_thinking=False) == off
    assert tok.apply_chat_template(hi, enable_thinking=True) == off.removesuffix("\n</think>\n\n")
    past = hi + [{"role": "assistant", "content": "Hello, how can I help you today?"}]
    assert tok.apply_chat_template(past, add_generation_prompt=False, enable_thinking=True) == (
        "<s><|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHello, how can I help you today?<|im_end|>\n"
    )
    # <think> and </think>: one token each, kept by decoding without special tokens.
    ids = tok.encode("<think>\nThe user says hello.\n</think>\n\nHi", add_special_tokens=False)
    think, end = tok.vocab()["<think>"], tok.vocab()["</think>"]
    assert ids.count(think) == 1 and ids.count(end) == 1
    assert tok.decode(ids).startswith("<think>\nThe user says hello.\n</think>")
    assert tok.vocab_size == json.loads((STORIES_DIR / "config.json").read_text())["vocab_size"]
    prompt = tok.encode(off, add_special_tokens=False)
    assert prompt[0] == tok.vocab()["<s>"] and prompt.count(prompt[0]) == 1


def reasoned(seed: int, n: int) -> list[tuple[list[dict], tuple, str | None]]:
    rng = random.Random(seed)
    return [grammar.reasoned_conversation(rng) for _ in range(n)]


def test_the_reasoning_the_grammar_writes_is_accepted_and_its_answers_as_before():
    """Every conversation with thinking reads as reasoning of the grammar, </think>, and an answer
    it gives (a call, JSON or sentences); about half of them think; each reasoning template comes
    up; and the reasoning says the facts its answer uses."""
    convs = reasoned(9, 1500)
    thinking = [c for c in convs if c[2] is not None]
    assert 0.4 < len(thinking) / len(convs) < 0.6
    seen = set()
    for messages, tools, reasoning in convs:
        doc = reply(messages, tools, reasoning)
        prompt = generation_prompt(messages[:-1], tools, thinking=reasoning is not None)
        written = doc[len(prompt) :].removesuffix("<|im_end|>\n")
        if reasoning is None:
            assert "</think>" not in written and accepts_answer(written), written
            continue
        r = read_thinking(written)
        assert r.accepted, written
        seen.update(r.reasoning.accepted)
        last = messages[-1]
        if last.get("tool_calls"):
            character = last["tool_calls"][0]["function"]["arguments"]["character"]
            assert reasoning.endswith(f"{character}.")
        elif messages[0]["content"].startswith("Who is"):  # the answer restates the reasoning
            kind_place = reasoning.split(". ")
            assert kind_place[0].split(" is a ")[1] in last["content"]
    for template in grammar.REASONS:
        pattern = template.split("{")[0][:12]
        assert any(pattern.lower() in s.lower() for s in seen), template


@pytest.mark.parametrize(
    "text",
    [
        "The cat is Tom's pet.\n</think>\n\nThe cat is in the park.",
        "<think>\nI need where_is for Tom.\n</think>\n\n"
        '<tool_call>\n{"name": "where_is", "arguments": {"character": "Tom"}}\n</tool_call>',
        "Mia is a kind bird. Mia lives near the park.\n</think>\n\n"
        '{"name": "Mia", "kind": "bird", "home": "park"}',
    ],
)
def test_a_reply_with_reasoning_is_accepted(text):
    assert read_thinking(text).accepted


@pytest.mark.parametrize(
    "text",
    [
        "The cat is Tom's pet.\n\nThe cat is in the park.",  # the block never closes
        "The cat is Tom's pet.\n</think>\n\n",  # no answer
        "\n</think>\n\nThe cat is in the park.",  # no reasoning
        "The cat is in the park.\n</think>\n\nThe cat is in the park.",  # an answer, not a fact
        "The cat is Tom's pet\n</think>\n\nThe cat is in the park.",  # unfinished
        "The cat is Tom's pet. <think>\n</think>\n\nThe cat is in the park.",  # opened twice
        "The cat is Tom's pet.\n</think>\n\nThe cat is on the moon.",  # not an answer
        'Mia is a kind bird.\n</think>\n\n{"name": "Mia", "kind": "moon", "home": "park"}',
    ],
)
def test_near_misses_of_a_reply_with_reasoning_are_rejected(text):
    assert not read_thinking(text).accepted


def test_the_reasoning_templates_are_not_story_sentences():
    """A story that wanders into reasoning reads as refused: the two sets of templates stay apart."""
    assert not accepts("I need where_is for the cat.")
    assert accepts("I need where_is for the cat.", grammar.REASONS)
    assert not accepts("Once upon a time, there was a big dog named Tom.", grammar.REASONS)


def test_the_corpus_is_a_function_of_its_seed():
    a, b, c = corpus(0, 200_000), corpus(0, 200_000), corpus(1, 200_000)
    assert a == b and a != c
    assert 200_000 <= sum(len(d) + 1 for d in a) < 202_000
    chats = [d for d in a if d.startswith("<|im_start|>user\n")]
    assert 0.2 < len(chats) / len(a) < 0.4  # stories and chat turns both
    tools = corpus(0, 200_000, "stories+tools")
    assert tools == corpus(0, 200_000, "stories+tools") and tools != a
    called = [d for d in tools if "<tool_call>" in d]
    assert 0.15 < len(called) / len(tools) < 0.35 and not any("<tool_call>" in d for d in a)
    # The corpus of the reasoning run: its chats all open the think block, half of them empty;
    # the corpora before it never do (they render as they did for the runs that used them).
    think = corpus(0, 200_000, "stories+tools+think")
    assert think == corpus(0, 200_000, "stories+tools+think")
    chats = [d for d in think if d.startswith("<|im_start|>")]
    assert all("<think>\n" in d for d in chats) and 0.5 < len(chats) / len(think) < 0.7
    empty = [d for d in chats if "<think>\n\n</think>" in d]
    assert 0.4 < len(empty) / len(chats) < 0.6
    assert not any("<think>" in d for d in a + tools)


def story_model_and_tokenizer(**sizes: int):  # noqa: ANN201
    """A small StoryModel with random weights from seed 0 (the committed checkpoint's
    tokenizer, so that `save` has one to write)."""
    from tokenizers import Tokenizer

    from pdserve.bench.stories.train import Shape, StoryModel
    from pdserve.engine.embedded.catalog import STORIES_DIR

    tok = Tokenizer.from_file(str(STORIES_DIR / "tokenizer.json"))
    shape = Shape(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
    )
    for name, value in sizes.items():
        setattr(shape, name, value)
    torch.manual_seed(0)
    return StoryModel(shape), tok


def test_the_training_forward_is_transformers_llama_on_the_weights_it_saves(tmp_path):
    """The trainer's model is the engine's layers with a causal forward of its own; saved under
    Hugging Face's names (q, k, v and gate, up split out of the engine's fused projections), its
    weights give transformers' Llama the logits it computes, to float32 rounding."""
    import transformers

    from pdserve.bench.stories.train import save

    model, tok = story_model_and_tokenizer(rope_theta=500.0, rms_norm_eps=1e-6)
    with torch.no_grad():
        for param in model.parameters():
            # Weights large enough for attention to pick positions (rotary and the causal mask
            # then matter), norms away from one, all in bfloat16's values (what save writes).
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(std=0.2)
            param.copy_(param.bfloat16().float())
    save(model, tok, tmp_path, record={})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(
        0, model.shape.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits)


def test_every_weight_of_the_training_model_takes_a_gradient():
    """Training reaches every weight through the engine's modules (no packed inference copy in
    the way), and a model whose linear layers are packed for inference is refused."""
    import torch.nn.functional as F

    from pdserve.bench.stories.train import StoryModel
    from pdserve.engine.cpu.linear import pack

    model, _ = story_model_and_tokenizer()
    ids = torch.randint(
        0, model.shape.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1)
    )
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    pack(model.llama)
    with pytest.raises(ValueError, match="packed"):
        StoryModel(model.shape, model.llama)


def test_growing_the_vocabulary_keeps_the_model_and_starts_new_rows_at_the_mean():
    from pdserve.bench.stories.train import grow_vocab

    model, _ = story_model_and_tokenizer()
    n = model.shape.vocab_size
    grown = grow_vocab(model, n + 2)
    assert grown.shape.vocab_size == n + 2 and model.shape.vocab_size == n
    ids = torch.randint(0, n, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(grown(ids)[..., :n], model(ids))
        old = model.llama.embed_tokens.weight
        new = grown.llama.embed_tokens.weight
        torch.testing.assert_close(new[n:], old.mean(0).expand(2, -1))
    assert grown.llama.lm_head.weight is new  # still tied


def test_the_loss_skips_the_close_of_an_empty_think_block_and_nothing_else():
    """Thinking off, the template writes `<think>\n\n</think>\n\n`; learned, its `\n</think>`
    would have the model close the block at once when thinking is on. The loss skips those two
    tokens of it, and no token of a reply with reasoning."""
    from tokenizers import Tokenizer

    from pdserve.bench.stories.train import token_stream, unlearned_empty_blocks
    from pdserve.engine.embedded.catalog import STORIES_DIR

    tok = Tokenizer.from_file(str(STORIES_DIR / "tokenizer.json"))
    hello = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello, how can I help you today?"},
    ]
    docs = [reply(hello), reply(hello, (), "The user says hello."), "The end."]
    data = token_stream(tok, docs)
    labels = unlearned_empty_blocks(tok, data)
    skipped = labels == -100
    assert tok.decode(data[skipped].tolist(), skip_special_tokens=False) == "\n</think>"
    assert torch.equal(labels[~skipped], data[~skipped])
    first = tok.encode(docs[0]).ids
    assert skipped[: len(first)].sum() == 2 and not skipped[len(first) :].any()


def test_the_training_script_writes_a_checkpoint_transformers_reads_as_trained(tmp_path):
    import torch.nn.functional as F
    import transformers
    from checkpoints import hf_greedy

    from pdserve.bench.stories.train import (
        Recipe,
        Shape,
        StoryModel,
        load_checkpoint,
        token_stream,
        train,
    )
    from pdserve.engine import LLM, SamplingParams

    shape = Shape(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=128,
    )
    recipe = Recipe(
        corpus_megabytes=0.2, steps=12, warmup_steps=1, lr=1e-2, batch_size=4, seq_len=32, threads=1
    )
    record = train(shape, recipe, tmp_path, plot=tmp_path / "loss.png", progress=False)
    assert (tmp_path / "loss.png").stat().st_size > 1000 and len(record["losses"]) == 12
    assert json.loads((tmp_path / "training.json").read_text())["final_loss"] > 0

    # Read back by pdserve's loader, its logits are those of the model transformers loads, and
    # pdserve serves it with transformers' greedy tokens.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tok, _, mine = load_checkpoint(tmp_path)
    ids = torch.randint(0, shape.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(mine(ids), hf(ids).logits)
    prompts = [tok.encode(text).ids for text in ("Once upon a time", "Tom and Lily", "One day")]
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    served = [out.token_ids for out in llm.generate(prompts, greedy)]
    assert served == hf_greedy(tmp_path, prompts, 16)

    # And they are the trained weights: on the corpus the saved model predicts the next token
    # better than the same shape as training began (the seed's initial weights).
    docs = corpus(recipe.seed, 20_000, recipe.corpus)
    window = token_stream(tok, docs)[: 8 * 33].reshape(8, 33)

    def loss(model) -> float:
        with torch.no_grad():
            logits = model(window[:, :-1])
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)
        ).item()

    torch.manual_seed(recipe.seed)
    initial = StoryModel(shape)
    assert loss(mine) < 0.9 * loss(initial)


def test_going_on_with_the_reasoning_corpus_adds_the_think_tokens(tmp_path):
    """A checkpoint without <think> and </think> gets them as its tokenizer's next two ids, not
    special, with rows of the embedding for them; transformers reads the result."""
    import transformers
    from tokenizers import Tokenizer

    from pdserve.bench.stories.train import Recipe, Shape, train

    tiny = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    sizes = dict(corpus_megabytes=0.1, warmup_steps=1, batch_size=2, seq_len=32, threads=1)
    before, after = tmp_path / "before", tmp_path / "after"
    train(Shape(vocab_size=400, **tiny), Recipe(steps=1, **sizes), before, None, False)
    n = json.loads((before / "config.json").read_text())["vocab_size"]
    think = Recipe(steps=2, corpus="stories+tools+think", init_from=str(before), **sizes)
    record = train(Shape(), think, after, None, False)
    tok = Tokenizer.from_file(str(after / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<think>", "</think>")] == [n, n + 1]
    assert tok.decode([n, n + 1], skip_special_tokens=True) == "<think></think>"
    assert json.loads((after / "config.json").read_text())["vocab_size"] == n + 2
    assert record["shape"]["vocab_size"] == n + 2 and record["init"]["shape"]["vocab_size"] == n
    hf = transformers.AutoModelForCausalLM.from_pretrained(after, dtype=torch.float32)
    assert hf.get_input_embeddings().weight.shape[0] == n + 2
