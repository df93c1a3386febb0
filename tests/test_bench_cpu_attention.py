"""pdserve.bench.cpu_attention: the kernel, another build of a C source and the torch reference timed on
the same shuffled-pool decode inputs; one row per point of the sweep."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.bench import cpu_attention
from pdserve.kernels import attention_ref, paged_attention_cpu

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler")


def test_decode_inputs_scatter_each_sequence_over_distinct_blocks():
    inputs = cpu_attention.decode_inputs(3, 40, (4, 2, 32))
    tables = inputs["block_tables"]
    assert tables.shape == (3, 3)  # 40 tokens: 3 blocks of 16
    assert len(set(tables.flatten().tolist())) == 9
    assert int(tables.max()) < inputs["k_cache"].shape[0]
    assert inputs["query"].shape == (3, 4, 32) and inputs["k_cache"].dtype == torch.float32
    got = paged_attention_cpu.paged_attention(**inputs)
    torch_ref = attention_ref.paged_attention(**inputs)
    assert (got - torch_ref).abs().max() < 1e-4


def test_the_sweep_times_every_version_and_writes_its_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--shapes", "llama-9m", "--batches", "2", "--contexts", "20", "--threads", "1"]
    other = [
        "--other-source",
        str(paged_attention_cpu.SOURCE),
        "--reps",
        "5",
        "--json-out",
        str(out),
    ]
    assert cpu_attention.main(args + other) == 0
    results = json.loads(out.read_text())
    assert results["command"].startswith("python -m pdserve.bench.cpu_attention --shapes")
    assert results["other"] == "paged_attention_cpu"
    (row,) = results["rows"]
    assert row["shape"] == "llama-9m" and row["batch"] == 2 and row["threads"] == 1
    assert row["kernel_us"] > 0 and row["other_us"] > 0 and row["reference_us"] > 0
    table = capsys.readouterr().out
    header, rule, line = table.splitlines()[-3:]
    assert header.count("|") == rule.count("|") == line.count("|")
    assert table.endswith(cpu_attention.docs_table(results) + "\n")


def test_an_unknown_shape_is_refused():
    with pytest.raises(SystemExit):
        cpu_attention.main(["--shapes", "llama-7b"])
