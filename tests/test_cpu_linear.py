"""Linear layers on packed oneDNN weights: the same products as F.linear for any batch, the
choice of when to pack (CPU, float32, not compiled), and a model whose projections all run packed
giving the same greedy tokens as one on F.linear."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cpu import linear as cpu_linear
from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.engine.tp.parallel_layers import ParallelLMHead, RowParallelLinear

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("rows", [1, 7, 17, 32, 300, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_f_linear_for_any_batch(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.BATCH_HINT)
    got = cpu_linear.linear(x, w, b, packed)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert cpu_linear.linear(x, w, b, None).equal(torch.nn.functional.linear(x, w, b))


def test_a_batch_of_any_shape_keeps_its_leading_dimensions():
    w, x = torch.randn(24, 8), torch.randn(3, 100, 8)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.BATCH_HINT)
    got = cpu_linear.linear(x, w, None, packed)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_rows_are_padded_to_few_counts_by_at_most_an_eighth():
    counts = cpu_linear.row_counts()
    assert len(counts) <= 48 and max(counts) == cpu_linear.MAX_ROWS
    for m in range(1, cpu_linear.MAX_ROWS + 1):
        padded = cpu_linear.padded_rows(m)
        assert padded in counts and m <= padded <= m + m // 8
        if m <= cpu_linear.EXACT_ROWS:
            assert padded == m  # a decode batch of a few sequences runs as it is


def test_onednn_is_called_only_with_the_padded_row_counts(monkeypatch):
    seen: set[int] = set()
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):  # noqa: ANN001, ANN002, ANN202
        seen.add(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    w = torch.randn(16, 8)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.BATCH_HINT)
    for m in range(1, 3 * cpu_linear.MAX_ROWS):
        cpu_linear.linear(torch.randn(m, 8), w, None, packed)
    assert seen == set(cpu_linear.row_counts())


def test_memory_stays_flat_whatever_the_row_counts():
    # oneDNN keeps a kernel (about 0.6 MiB here) for every row count it meets: unpadded, a
    # second pass over 1..1024 rows grew the process by over 1 GiB.
    script = textwrap.dedent("""
        import torch
        from pdserve.engine.cpu import linear as cpu_linear
        torch.set_num_threads(1)
        def rss_mib():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        layer = cpu_linear.Linear(256, 768)
        cpu_linear.pack(layer)
        x = torch.randn(1024, 256)
        grown = []
        for _ in range(2):
            before = rss_mib()
            for m in range(1, 1025):
                layer(x[:m])
            grown.append(rss_mib() - before)
        print(*grown)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=True
    )
    first, second = (float(v) for v in out.stdout.split())
    assert first < 100, f"the first pass over every row count grew {first:.0f} MiB"
    assert second < 4, f"a second pass grew {second:.1f} MiB"


def test_pack_covers_every_layer_that_runs_through_linear_and_nothing_else():
    model = nn.Sequential(
        cpu_linear.Linear(8, 16),
        RowParallelLinear(16, 8, True, None),
        nn.Linear(8, 8),  # not ours: left alone
        ParallelLMHead(range(50), 8, 50, None),
    )
    for m in model.modules():
        for p in m.parameters(recurse=False):
            nn.init.normal_(p)
    x = torch.randn(5, 8)
    before = model(x)
    assert cpu_linear.pack(model) == 3
    assert not hasattr(model[2], "packed") and model[2].weight.shape == (8, 8)
    assert [model[i].weight.numel() for i in (0, 1, 3)] == [0, 0, 0]  # the plain copies dropped
    scale = before.abs().max().item()  # four layers of N(0, 1) weights: outputs in the hundreds
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6 * scale)


def test_a_weight_shared_with_an_embedding_is_kept_for_the_lookup():
    embed = nn.Embedding(50, 8)
    head = ParallelLMHead(range(50), 8, 50, None)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    h = embed(torch.tensor([3, 4]))
    before = head(h)
    assert cpu_linear.pack(model) == 1
    assert head.weight is embed.weight and embed.weight.shape == (50, 8)
    torch.testing.assert_close(head(h), before, rtol=1e-5, atol=1e-5)


def test_the_choice_packs_cpu_float32_eager_nodes_only(caplog):
    assert cpu_linear.choose("auto", "cpu", "float32", compiled=False)
    assert cpu_linear.choose("onednn", "cpu", "float32", compiled=False)
    assert not cpu_linear.choose("torch", "cpu", "float32", compiled=False)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.cpu.linear"):
        assert not cpu_linear.choose("auto", "cpu", "bfloat16", compiled=False)
        assert not cpu_linear.choose("auto", "cuda:0", "float32", compiled=False)
        assert not caplog.records  # auto falls back quietly
        assert not cpu_linear.choose("onednn", "cpu", "float32", compiled=True)
        assert not cpu_linear.choose("onednn", "cpu", "bfloat16", compiled=False)
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "the compiled step packs its own weights; linear layers run through F.linear",
        "packed linear layers are float32 only (this node runs bfloat16); linear layers run "
        "through F.linear",
    ]


def test_a_packed_model_generates_the_same_greedy_tokens_as_f_linear():
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13] * 9, [4]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "onednn"):
        llm = LLM(ensure_tiny_model(), dtype="float32", device="cpu", cpu_linear=backend)
        shard_model = llm.engine.runner.model
        packed = [m for m in shard_model.modules() if getattr(m, "packed", None) is not None]
        layers = shard_model.config.num_layers
        assert len(packed) == (4 * layers + 1 if backend == "onednn" else 0)
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
        llm.close()
    assert tokens["onednn"] == tokens["torch"]


@pytest.mark.parametrize("rows", [1, 7, 40, 300])
def test_packed_experts_give_the_reference_moe(rows):
    # A Qwen2-MoE layer (shared expert and its gate beside 4 routed experts, top-2): packing
    # makes each expert's two matrices oneDNN's and drops the stacked ones.
    from pdserve.engine.models.config import ModelConfig
    from pdserve.engine.models.llama import MLP
    from pdserve.engine.models.moe import SparseMoE
    from pdserve.engine.tp.shard import TPShard
    from pdserve.kernels.ops import REFERENCE

    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen2_moe",
            "vocab_size": 8,
            "hidden_size": 40,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 32,
        }
    )
    torch.manual_seed(rows)
    moe = SparseMoE(cfg, TPShard(), None, MLP)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.2)
    x = torch.randn(rows, 40)
    with torch.no_grad():
        before = moe(x, REFERENCE)
        # gate_up, down of the shared expert, the router, the shared gate; 2 per routed expert
        assert cpu_linear.pack(moe) == 4 + 2 * 4
        assert moe.experts.w13.numel() == moe.experts.w2.numel() == 0
        torch.testing.assert_close(moe(x, REFERENCE), before, rtol=1e-5, atol=1e-5)


def test_the_benchmark_records_its_run_and_prints_the_docs_table(tmp_path, capsys):
    import json

    from pdserve.bench import cpu_linear as bench

    out = tmp_path / "linear.json"
    argv = ["--shape", "64x32", "--rows", "1,17,300", "--repeat", "3", "--memory-rows", "4"]
    assert bench.main([*argv, "--json-out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["command"].startswith("python -m pdserve.bench.cpu_linear --shape 64x32")
    assert results["load"]["before"] and results["load"]["after"]
    table = bench.docs_table(results, rows="1,17,300")
    assert table in capsys.readouterr().out
    assert table.startswith("| shape | 1 row | 17 rows | 300 rows |")
    assert "at 1 to 17 rows" in table and "64x32" in table
