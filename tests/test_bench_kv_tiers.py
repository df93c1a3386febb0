"""bench.kv_tiers, short: blocks written down to the host tier and loaded back through the tiers'
own code, beside a plain copy of the same bytes, into a results file that names its run."""

from __future__ import annotations

import json

from pdserve.bench.kv_tiers import main


def test_a_short_run_writes_down_loads_back_and_records_its_run(tmp_path, capsys):
    out = tmp_path / "kv_tiers.json"
    assert main(["--blocks", "2", "--repeats", "1", "--device", "cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    (row,) = results["rows"]
    assert row["blocks"] == 2 and row["gb"] == 2 * results["block_bytes"] / 1e9
    assert results["block_bytes"] == 32 * 2 * 16 * 8 * 128 * 4  # Llama-3-8B's layout, float32
    for key in ("store_gbps", "plain_down_gbps", "load_gbps", "plain_up_gbps"):
        assert row[key] > 0
    assert results["command"].startswith("python -m pdserve.bench.kv_tiers")
    assert results["commit"] and results["date"] and results["machine"]["cpu"]
    assert "| 2 | 8 |" in capsys.readouterr().out
