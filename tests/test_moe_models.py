"""Mixtral, Qwen2-MoE and Qwen3-MoE from tiny transformers checkpoints (4 experts, top-2, every
expert used): greedy tokens equal transformers' in float32 at two block sizes, with the experts on
weights packed for oneDNN and through the reference op; tensor-parallel
groups of 2 and 4 ranks (gloo) equal one rank; preemption, chunked prefill and prefix-cache hits
change nothing; a checkpoint missing an expert, or with one misshapen, is refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoints import MOE_FAMILIES
from conftest import FAMILY_NEW_TOKENS, random_prompts
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ModelConfig

NEW_TOKENS = FAMILY_NEW_TOKENS
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_expert_receives_tokens_and_each_token_two(family_run, family):
    """What makes the parity below a test of routing: no expert idle, top-k above one."""
    import transformers

    model_dir, prompts, _ = family_run(family)
    cfg = ModelConfig.from_pretrained(model_dir)
    assert cfg.num_experts_per_tok == 2 and cfg.num_experts == 4
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([sum(prompts, [])])
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits
    assert len(router_logits) == len(cfg.sparse_layers)
    for logits in router_logits:
        chosen = torch.topk(logits, 2, dim=-1).indices
        assert set(chosen.flatten().tolist()) == {0, 1, 2, 3}


def test_a_dense_layer_sits_between_sparse_ones_in_the_qwen3_moe_checkpoint(family_run):
    model_dir, _, _ = family_run("qwen3_moe")
    llm = LLM(str(model_dir), num_kv_blocks=16, device="cpu")
    layers = llm.engine.model.layers
    kinds = [type(layer.mlp).__name__ for layer in layers]
    assert kinds == ["SparseMoE", "MLP", "SparseMoE"]


@pytest.mark.parametrize(
    ("block_size", "cpu_linear"), [(16, "onednn"), (7, "onednn"), (16, "torch")]
)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_tokens_equal_transformers(family_run, family, block_size, cpu_linear):
    # onednn: the experts on packed weights (a CPU node's default); torch: the reference op
    model_dir, prompts, expected = family_run(family)
    llm = LLM(
        str(model_dir),
        block_size=block_size,
        num_kv_blocks=1024 // block_size,
        device="cpu",
        cpu_linear=cpu_linear,
    )
    experts = llm.engine.model.layers[0].mlp.experts
    assert (experts.packed_experts is not None) == (cpu_linear == "onednn")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize(
    ("family", "size"),
    [(family, size) for size in (2, 4) for family in MOE_FAMILIES],
)
def test_tensor_parallel_groups_equal_one_rank(family_run, family, size):
    # At 4 ranks each of the 2 KV heads lives on two ranks, and every expert (and the shared
    # expert) keeps 12 (24) of its 48 (96) columns per rank.
    model_dir, prompts, expected = family_run(family)
    with LLM(str(model_dir), num_kv_blocks=64, device="cpu", tensor_parallel_size=size) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


TIGHT = dict(num_kv_blocks=20, block_size=8, max_num_batched_tokens=32, device="cpu")


def test_preemption_chunking_and_prefix_hits_change_nothing(family_run):
    model_dir, _, _ = family_run("qwen2_moe")
    roomy = LLM(str(model_dir), num_kv_blocks=256, block_size=8, device="cpu")
    tight = LLM(str(model_dir), **TIGHT, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = random_prompts(2, [20, 25, 30, 22]) + random_prompts(3, [100])
    shared = random_prompts(4, [40])[0]
    prompts += [shared + [5 + i] for i in range(2)]
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    steps = tight.engine.stats.num_steps
    got = [o.token_ids for o in tight.generate(prompts[:5], params)]
    got += [o.token_ids for p in prompts[5:] for o in tight.generate([p], params)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.prefix_hits >= 5  # the second shared prompt's 5 blocks
    assert tight.engine.stats.num_steps - steps >= 4  # the 100-token prompt took 4 chunks


def rewritten(src, dst, change) -> str:  # noqa: ANN001
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def test_a_missing_or_misshapen_expert_is_refused_by_name(family_run, tmp_path):
    model_dir, _, _ = family_run("mixtral")
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    missing = rewritten(model_dir, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing weight '{name}'"):
        LLM(missing, num_kv_blocks=16, device="cpu")

    def narrow(tensors):  # noqa: ANN001, ANN202
        tensors[name] = tensors[name][:, :-1].contiguous()

    misshapen = rewritten(model_dir, tmp_path / "misshapen", narrow)
    with pytest.raises(ValueError, match=f"weight '{name}' has shape"):
        LLM(misshapen, num_kv_blocks=16, device="cpu")
