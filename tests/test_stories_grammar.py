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
from pdserve.bench.stories.corpus import CHAT_TEMPLATE, corpus, render
from pdserve.bench.stories.recognizer import (
    accepts,
    accepts_call,
    read,
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
    served = tok.apply_chat_template(sent, add_generation_prompt=False, tools=list(grammar.TOOLS))
    assert served == render(messages, grammar.TOOLS)
    assert "Tools: where_is(character)" in served and "<tool_call>" in served
    # The prompt of its first turn ends where the assistant's call begins.
    prompt = tok.apply_chat_template(sent[:1], tools=list(grammar.TOOLS))
    assert served.startswith(prompt) and served[len(prompt) :].startswith("<tool_call>")


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
