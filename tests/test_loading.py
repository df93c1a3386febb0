"""Checkpoint loading: shards, and errors that name what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from checkpoints import build_checkpoint
from conftest import random_prompts
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import UnsupportedModelError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, checkpoint_dir):
    sharded = build_checkpoint("llama", tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompts = random_prompts(3, [9, 20])
    a = LLM(str(checkpoint_dir("llama")), num_kv_blocks=32).generate(prompts, GREEDY)
    b = LLM(str(sharded), num_kv_blocks=32).generate(prompts, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_missing_weight_is_named(tmp_path, checkpoint_dir):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint_dir("qwen2"), broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        LLM(str(broken), num_kv_blocks=8)


def _with_config(tmp_path, checkpoint_dir, **changes):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("llama"), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


def test_unsupported_model_type_is_named(tmp_path, checkpoint_dir):
    model_dir = _with_config(tmp_path, checkpoint_dir, model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="model_type.*gpt2"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_unsupported_rope_scaling_is_named(tmp_path, checkpoint_dir):
    model_dir = _with_config(
        tmp_path, checkpoint_dir, rope_scaling={"rope_type": "longrope", "factor": 4.0}
    )
    with pytest.raises(UnsupportedModelError, match="rope_scaling.rope_type.*longrope"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_legacy_rope_fields_load_like_rope_parameters(tmp_path, checkpoint_dir):
    # Hub checkpoints written by transformers 4.x carry rope_theta and rope_scaling instead.
    cfg = json.loads((checkpoint_dir("llama") / "config.json").read_text())
    params = dict(cfg["rope_parameters"])
    theta = params.pop("rope_theta")
    model_dir = _with_config(
        tmp_path, checkpoint_dir, rope_parameters=None, rope_theta=theta, rope_scaling=params
    )
    prompts = random_prompts(4, [12])
    a = LLM(str(checkpoint_dir("llama")), num_kv_blocks=16).generate(prompts, GREEDY)
    b = LLM(str(model_dir), num_kv_blocks=16).generate(prompts, GREEDY)
    assert a[0].token_ids == b[0].token_ids


def test_prompt_beyond_context_is_rejected_before_running():
    llm = LLM(num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        llm.generate([list(range(4, 70))], GREEDY)
    assert llm.engine.block_manager.num_free_blocks == 16


def test_chat_template_renders_roles():
    llm = LLM(num_kv_blocks=8)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.tokenizer.decode(llm.tokenizer.encode("Hello, world!")) == "Hello, world!"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_generate_on_embedded_model_and_on_a_checkpoint(checkpoint_dir):
    tiny = _cli("generate", "--prompt", "Hello", "--max-tokens", "8", "--ignore-eos")
    assert tiny.returncode == 0, tiny.stderr
    expected = LLM(num_kv_blocks=16).generate(["Hello"], GREEDY)[0].text
    assert tiny.stdout == expected + "\n"
    ckpt = _cli("generate", "--model", str(checkpoint_dir("qwen3")), "--prompt", "Hi there")
    assert ckpt.returncode == 0, ckpt.stderr


def test_cli_bad_input_is_one_line():
    res = _cli("generate", "--model", "/no/such/dir", "--prompt", "x")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "does not exist" in res.stderr
