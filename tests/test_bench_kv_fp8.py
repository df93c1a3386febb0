"""The FP8 KV cache's benchmarks, short. bench.kv_fp8: the embedded model with an FP8 cache
against its float32 cache; the bytes per token are what the page format says (2 x KV heads x
(head_dim + 4) per layer), the shares are shares, and the log-probability gap is measured where
the runs share their context. bench.kv_transfer --kv-cache-dtype: both dtypes' pages move in the
same rounds, their bytes the layouts' arithmetic. bench.kv_fp8_scales: each scale granularity's
bytes per token exact, its groups the ones it names, its errors measured against the float
cache."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.bench import kv_fp8_scales as scales
from pdserve.bench import kv_transfer
from pdserve.bench.kv_fp8 import logprob_gaps, main
from pdserve.engine.kv.cache import KVLayout


def test_a_short_run_measures_agreement_and_bytes(tmp_path):
    out = tmp_path / "kv_fp8.json"
    argv = ["--prompts", "4", "--max-tokens", "4", "--json-out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    sizes = res["kv_bytes_per_token"]
    layers, heads, head_dim = 4, 2, 32  # pdserve-stories
    assert sizes["fp8"]["per_layer"] == 2 * heads * (head_dim + 4)
    assert sizes["bfloat16"]["per_layer"] == 2 * heads * head_dim * 2
    assert sizes["fp8"]["all_layers"] == layers * sizes["fp8"]["per_layer"]
    assert res["fp8_over_bf16_bytes"] == (head_dim + 4) / (2 * head_dim)
    assert res["reference_kv_dtype"] == "float32" and res["command"].endswith(" ".join(argv))
    for share in ("tokens_equal_share", "first_tokens_equal_share", "outputs_equal_share"):
        assert 0 <= res[share] <= 1
    assert res["logprob_positions"] >= 4  # each prompt's first token at least
    assert res["mean_logprob_gap"] >= 0


def test_the_gap_stops_after_the_first_token_where_the_runs_part():
    ref = [{"token": (5, -0.5), "top": [(5, -0.5)]}, {"token": (6, -1.0), "top": [(6, -1.0)]}]
    fp8 = [
        {"token": (5, -0.75), "top": [(5, -0.75)]},
        {"token": (7, -0.5), "top": [(7, -0.5), (6, -2.0)]},
        {"token": (8, -0.1), "top": [(8, -0.1)]},
    ]
    assert logprob_gaps(ref, fp8, [5, 6, 9], [5, 7, 8]) == [0.25, 1.0]


@pytest.mark.timeout(120)
def test_both_kv_cache_dtypes_move_the_same_blocks_in_the_same_rounds(capsys):
    layout = KVLayout(2, 16, 2, 8, "bfloat16")  # 2 layers, 2 KV heads of 8
    res = kv_transfer.kv_dtype_compare(["tcp", "shm"], layout, [1, 4], ["contiguous"], 2, 1 << 20)
    auto = 2 * 2 * 2 * 8 * 2  # layers x K/V x heads x head_dim x 2 bytes
    fp8 = 2 * 2 * 2 * (8 + 4)  # a row: head_dim float8 bytes and a float32 scale
    assert res["kv_cache_dtypes"]["auto"]["bytes_per_token"] == auto
    assert res["kv_cache_dtypes"]["fp8"]["bytes_per_token"] == fp8
    assert res["kv_cache_dtypes"]["fp8"]["layout"]["dtype"] == "fp8_e4m3"
    assert [(r["transport"], r["blocks"]) for r in res["rows"]] == [
        ("tcp", 1),
        ("tcp", 4),
        ("shm", 1),
        ("shm", 4),
    ]
    for row in res["rows"]:
        assert row["auto"]["bytes"] == row["blocks"] * 16 * auto
        assert row["fp8"]["bytes"] == row["blocks"] * 16 * fp8
        assert row["fp8"]["bytes_over_auto"] == fp8 / auto
        assert len(row["auto"]["times_s"]) == len(row["fp8"]["times_s"]) == 2
        ratios = sorted(f / a for a, f in zip(row["auto"]["times_s"], row["fp8"]["times_s"]))
        assert row["fp8"]["time_over_auto"] == pytest.approx(sum(ratios) / 2)  # fp8 over auto
    out = capsys.readouterr().out
    assert "| tcp | contiguous | 4 | 0.0 |" in out and "| 0.750 |" in out
    assert "| fp8 | fp8_e4m3 | 2 | 2 × 2 × 12 | 96 |" in kv_transfer.kv_dtype_bytes(res)


def test_bytes_per_token_of_each_granularity():
    sizes = scales.bytes_per_token(num_layers=4, num_kv_heads=2, head_dim=32)
    values = 2 * 4 * 2 * 32
    assert sizes["token"] == values + 2 * 4 * 2 * 4  # a float32 per (token, K/V, layer, head)
    assert sizes["block"] == values + 2 * 4 * 2 * 4 / 16  # one per 16 tokens
    assert sizes["head static"] == sizes["layer static"] == sizes["scale 1.0"] == values
    assert sizes["bfloat16"] == 2 * values


def test_a_block_scale_spans_its_own_tokens_and_a_token_scale_its_own_row():
    x = torch.full((1, 20, 8), 1e-4)  # 20 tokens: blocks of 16 and 4
    x[0, 0] = 448.0  # one loud token in the first block
    blocked, rowed = scales.per_block(x), scales.per_token(x)
    assert torch.equal(blocked[0, 0], x[0, 0])
    assert torch.all(blocked[0, 1:16] == 0)  # under the loud token's scale: below FP8's range
    assert torch.allclose(blocked[0, 16:], x[0, 16:], rtol=0.07)  # the second block: its own
    assert torch.allclose(rowed, x, rtol=0.07)  # each token its own scale
    quiet = torch.rand(2, 16, 8) + 0.5  # rows of equal amax: block and token scales agree
    quiet[..., 0] = 1.5
    assert torch.equal(scales.per_block(quiet), scales.per_token(quiet))


def test_static_scales_clamp_beyond_the_calibration_and_unit_scale_beyond_448():
    amax = (torch.tensor([1.0, 4.0]), torch.tensor([2.0, 8.0]))  # K and V amax of 2 heads
    quant = scales.quantizers(amax)
    k = torch.full((2, 1, 4), 2.0)
    assert quant["head static"][0](k)[:, 0, 0].tolist() == [1.0, 2.0]  # head 0 clamped
    assert quant["layer static"][0](k)[:, 0, 0].tolist() == [2.0, 2.0]  # amax 4 over both heads
    assert quant["head static"][1](k * 4)[:, 0, 0].tolist() == [2.0, 8.0]
    assert quant["scale 1.0"][0](k * 300)[:, 0, 0].tolist() == [448.0, 448.0]


def test_errors_are_against_the_float_cache():
    """V of a quiet token beside a loud one: a block's scale rounds the quiet token to zero, and
    the attention output, which reads it, moves; a token's scale keeps it."""
    query = torch.randn(2, 16, 8)
    key = torch.ones(1, 16, 8)  # every token equally attended
    value = torch.full((1, 16, 8), 1e-4)
    value[0, 0] = 448.0
    amax = [(torch.tensor([1.0]), torch.tensor([448.0]))]
    errors = scales.compare([[(query, key, value, 0.35)]], amax)
    assert errors["token"]["K"] == 0 and errors["token"]["V"] < 1e-3
    block = errors["block"]
    assert block["V"] > 0 and block["attention"] > 10 * errors["token"]["attention"]
    assert block["attention_worst_layer"] == block["attention"]  # one layer


@pytest.mark.timeout(120)
def test_a_short_run_of_the_granularities(tmp_path):
    pytest.importorskip("transformers")  # captures the prefills' K, V and queries
    out = tmp_path / "scales.json"
    argv = ["--model", "pdserve-tiny", "--text", "random", "--prompts", "2", "--calibration", "1"]
    argv += ["--prompt-len", "20", "40", "--json-out", str(out)]
    assert scales.main(argv) == 0
    res = json.loads(out.read_text())
    layers, heads, head_dim = 2, 2, 16  # pdserve-tiny
    assert res["layout"] == {"num_layers": layers, "num_kv_heads": heads, "head_dim": head_dim}
    lengths = [len(p) for p in scales.random_prompts(512, 3, 20, 40, 0)]
    assert res["tokens"] == sum(lengths[1:])  # the calibration prompt is not measured
    rows = res["granularities"]
    assert list(rows) == list(scales.GRANULARITIES)
    assert rows["token"]["bytes_per_token"] == 2 * layers * heads * (head_dim + 4)
    assert rows["block"]["over_bf16_bytes"] == round((head_dim + 0.25) / (2 * head_dim), 4)
    for row in rows.values():
        for what in ("K", "V", "attention"):
            assert 0 < row[what] < 0.2
        assert row["attention_worst_layer"] >= row["attention"]
    assert res["command"].endswith(" ".join(argv))


@pytest.mark.timeout(120)
def test_the_captured_keys_and_values_are_what_the_float_cache_holds():
    """The granularities are measured on the K and V pdserve's own float32 cache stores for the
    same prompt (its first block, in whichever block of the pool it landed)."""
    pytest.importorskip("transformers")
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.embedded.catalog import resolve_model_dir

    prompt = scales.random_prompts(512, 1, 20, 20, 0)[0]
    llm = LLM("pdserve-tiny", device="cpu", num_kv_blocks=8, block_size=16, max_num_seqs=1)
    assert llm.engine.layout.dtype == "float32"
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    (layers,) = scales.capture_prefills(str(resolve_model_dir("pdserve-tiny")), [prompt])
    assert len(layers) == 2
    for index, (query, key, value, scaling) in enumerate(layers):
        assert query.shape == (4, 20, 16) and key.shape == value.shape == (2, 20, 16)
        assert scaling == pytest.approx(16**-0.5)
        k_pages, v_pages = llm.engine.pool.layer(index)[:2]
        gaps = [(k_pages[b].transpose(0, 1) - key[:, :16]).abs().max() for b in range(8)]
        block = min(range(8), key=lambda b: gaps[b])
        assert gaps[block] < 1e-5
        assert torch.allclose(v_pages[block].transpose(0, 1), value[:, :16], atol=1e-5)
