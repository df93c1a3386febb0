"""pdserve.bench.cpu_variants: variants are engine settings, typed as their declarations say; one tiny
run of two variants side by side reports both."""

from __future__ import annotations

import pytest

from pdserve.bench.cpu_variants import main, parse_variant


def test_a_variant_is_a_name_and_typed_engine_settings():
    assert parse_variant("t1=cpu_threads:1,cpu_bind:0,compile:true") == (
        "t1",
        {"cpu_threads": 1, "cpu_bind": "0", "compile": True},
    )
    assert parse_variant("plain=") == ("plain", {})
    for bad in ("novalue", "x=cpu_threads", "x=threads:1"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_two_variants_run_side_by_side(capsys):
    out = main(
        [
            "--rounds",
            "1",
            "--num-requests",
            "3",
            "--min-prompt-len",
            "4",
            "--max-prompt-len",
            "20",
            "--min-output-len",
            "4",
            "--max-output-len",
            "8",
            "--hidden-size",
            "64",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--intermediate-size",
            "64",
            "--vocab-size",
            "300",
            "--variant",
            "ref=kernel_backend:torch",
            "--variant",
            "one=cpu_threads:1",
        ]
    )
    assert set(out["variants"]) == {"ref", "one"}
    assert all(v["median"] > 0 for v in out["variants"].values())
    assert "| one |" in capsys.readouterr().out
    assert out["command"].startswith("python -m pdserve.bench.cpu_variants --rounds 1")
