"""pdserve.bench.model_step on the CPU at a tiny shape: the script runs end to end, and the work it divides
by (FLOPs, bytes) is what the model really does."""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from pdserve.bench import model_step
from pdserve.engine.execution.runner import ModelRunner
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.kernels.ops import select_ops


def test_runs_every_combination_on_cpu(tmp_path):
    out = tmp_path / "steps.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--batches", "1,3", "--contexts", "16,40"]
    argv += ["--prompt-len", "24", "--prefill-prompts", "1,2", "--repeats", "2"]
    results = model_step.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == results
    assert [(r["batch"], r["context"]) for r in results["decode"]] == [
        (1, 16),
        (3, 16),
        (1, 40),
        (3, 40),
    ]
    for r in results["decode"]:
        assert r["graph_ms"] is None and r["eager_ms"] > 0 and 0 < r["fraction_of_copy"]
    assert [r["prompts"] for r in results["prefill"]] == [1, 2]
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in results["prefill"])


def test_prefill_flop_counts_the_model_matmuls():
    cfg = model_step.model_config("tiny")
    model = model_step.random_model(cfg, "float32", "cpu", 0)
    gen = torch.Generator().manual_seed(0)
    for prompts, prompt_len in [(1, 64), (3, 40)]:
        seqs, num_blocks = model_step.sequences(prompts, 0, prompt_len, cfg.vocab_size, gen)
        pool = model_step.kv_pool(cfg, "float32", num_blocks, "cpu")
        runner = ModelRunner(model, pool, select_ops("cpu"), "cpu")
        step = SchedulerOutput(scheduled=[ScheduledSeq(s, prompt_len) for s in seqs])
        with FlopCounterMode(display=False) as counter:
            logits, rows = runner.run(step)
        assert logits.shape == (prompts, cfg.vocab_size) and rows == list(range(prompts))
        # The counter sees the matmuls (the reference attention's masked SDPA goes uncounted).
        attention = cfg.num_layers * prompts * 2 * cfg.num_heads * cfg.head_dim * prompt_len**2
        expected = model_step.prefill_flop(cfg, prompts, prompt_len) - attention
        assert counter.get_total_flops() == expected


def test_decode_bytes_count_weights_once_and_each_context():
    cfg = model_step.model_config("tiny")
    model = model_step.random_model(cfg, "float32", "cpu", 0)
    pool = model_step.kv_pool(cfg, "float32", 4, "cpu")
    params = sum(p.numel() for p in model.parameters())
    table = cfg.vocab_size * cfg.hidden_size
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    got = model_step.decode_bytes(model, pool, 5, 100)
    assert got == 4 * (params - table + 5 * cfg.hidden_size + 5 * 101 * kv_per_token)


def test_tensor_parallel_steps_run_on_two_ranks_each_holding_about_half_the_weights():
    argv = ["--preset", "tiny", "--device", "cpu", "--batches", "2", "--contexts", "16"]
    argv += ["--prompt-len", "24", "--prefill-prompts", "1", "--repeats", "2"]
    one = model_step.main(argv)
    two = model_step.main([*argv, "--tensor-parallel-size", "2"])
    assert (one["tensor_parallel_size"], two["tensor_parallel_size"]) == (1, 2)
    # Everything is split but the norms, which every rank holds whole.
    assert 0.5 < two["weights_gb_per_rank"] / one["weights_gb_per_rank"] < 0.55
    assert two["decode"][0]["eager_ms"] > 0 and two["prefill"][0]["ms"] > 0
    assert two["decode"][0]["bytes_gb"] < one["decode"][0]["bytes_gb"]
