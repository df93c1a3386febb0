"""pdserve.bench.codec at tiny repeat counts: the script runs end to end, and both codecs it times carry
every message it times there and back unchanged, field by field."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

import msgspec
import pytest

from pdserve.bench import codec as bench_codec


def plain(value: Any) -> Any:
    """Any message, struct or dataclass, as nested dicts and lists of its field values."""
    if isinstance(value, msgspec.Struct):
        return {name: plain(getattr(value, name)) for name in value.__struct_fields__}
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


CASES = bench_codec.cases()


def test_times_the_messages_it_names():
    names = [case.name for case in CASES]
    for sequences in (1, 64, 256):
        assert f"Tokens, {sequences} seq" in names
        assert f"Tokens, {sequences} seq, top-5 logprobs" in names
    assert {"Heartbeat", "Prefill, 2048 token ids", "Event, 1 token"} <= set(names)
    by_name = {case.name: case.message for case in CASES}
    assert len(by_name["Tokens, 256 seq"].items) == 256
    assert all(len(i.logprobs.top) == 5 for i in by_name["Tokens, 64 seq, top-5 logprobs"].items)
    assert len(by_name["Prefill, 2048 token ids"].token_ids) == 2048
    assert len(by_name["Event, 1 token"].token_ids) == 1


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_msgspec_round_trips_field_by_field(case):
    decoded = case.codec.decode(case.codec.encode(case.message))
    assert type(decoded) is type(case.message)
    for name in case.message.__struct_fields__:
        assert getattr(decoded, name) == getattr(case.message, name), name


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_dataclass_baseline_carries_the_same_fields_and_round_trips(case):
    message = bench_codec.to_dataclass(case.message)
    fields = [f.name for f in dataclasses.fields(message)]
    assert fields == list(case.message.__struct_fields__)
    for name in fields:  # the baseline times the same content as msgspec
        assert plain(getattr(message, name)) == plain(getattr(case.message, name)), name
    decoded = case.baseline.decode(case.baseline.encode(message))
    assert type(decoded) is type(message)
    for name in fields:  # nested messages come back as dicts, as they did before msgspec
        assert plain(getattr(decoded, name)) == plain(getattr(message, name)), name


def test_the_baseline_refuses_another_version():
    case = CASES[0]
    frame = case.baseline.encode(bench_codec.to_dataclass(case.message))
    other = bench_codec.DataclassCodec(case.codec.version + 1, tuple(case.baseline.types.values()))
    with pytest.raises(bench_codec.ProtocolError, match="version"):
        other.decode(frame)


def test_runs_end_to_end_and_writes_json(tmp_path, capsys):
    out = tmp_path / "codec.json"
    results = bench_codec.main(["--repeats", "1", "--min-loop-ms", "0", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["command"].startswith("python -m pdserve.bench.codec --repeats 1")
    assert results["commit"] and results["load"]["after"] and results["machine"]["msgspec"]
    assert all(len(r["rounds_us"]["msgspec encode"]) == 1 for r in results["results"])
    printed = capsys.readouterr().out
    table = bench_codec.docs_table(results)
    assert table in printed and "| Tokens, 256 seq | 21,802 |" in table
    assert "Encoding is where" in bench_codec.docs_points(results)
    assert bench_codec.digest_sentence(results) in printed
    assert [r["message"] for r in results["results"]] == [case.name for case in CASES]
    for r, case in zip(results["results"], CASES, strict=True):
        old = case.baseline.encode(bench_codec.to_dataclass(case.message))
        assert r["dataclass"]["bytes"] == len(old)
        assert r["msgspec"]["bytes"] == len(case.codec.encode(case.message))
        for codec in ("dataclass", "msgspec"):
            assert r[codec]["encode_us"] > 0 and r[codec]["decode_us"] > 0
        assert r["encode_ratio"] > 0 and r["decode_ratio"] > 0 and r["asdict_us"] > 0
    assert printed.count("\n| Tokens, ") == 6
