"""A `vllm serve` command line starts `pdserve serve`: each vLLM flag parses; those pdserve has a
meaning for take it, the ignored ones say so in one line at start, the refused ones end the
command with one line saying what to use instead. No server is started."""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest

from pdserve.cli import build_parser, main
from pdserve.cluster.schema import values_from_args
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.vllm_flags import FLAGS, GROUP_TITLE, IGNORED, apply_vllm_flags

MISSING = "/nonexistent/model"  # serve stops at the model check, after the flags are applied


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def serve_stderr(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = main(["serve", *argv])
    return code, capsys.readouterr().err.splitlines()


EVERY_FLAG = [
    ("--trust-remote-code",),
    ("--disable-log-requests",),
    ("--disable-log-stats",),
    ("--uvicorn-log-level", "warning"),
    ("--max-logprobs", "5"),
    ("--tokenizer", MISSING),
    ("--generation-config", "vllm"),
    ("--revision", "main"),
    ("--download-dir", "/tmp/hub"),
    ("-tp", "2"),
    ("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'),
    ("--pipeline-parallel-size", "1"),
    ("-pp", "1"),
    ("--data-parallel-size", "1"),
    ("-dp", "1"),
]


@pytest.mark.parametrize("flag", EVERY_FLAG, ids=lambda f: f[0])
def test_every_vllm_flag_parses_on_serve(flag):
    parse(MISSING, *flag)


def test_the_vllm_flags_have_a_group_of_their_own_in_serve_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    group = out[out.index(GROUP_TITLE) :]
    for f in FLAGS:
        assert f.flag in group
    assert "-tp N" in group and "--max-logprobs" in group


def test_tp_is_the_short_form_of_tensor_parallel_size():
    assert parse("-tp", "2").tensor_parallel_size == 2
    assert vars(parse("-tp", "2")) == vars(parse("--tensor-parallel-size", "2"))
    assert not hasattr(parse(), "tensor_parallel_size")  # unset: the config file's or default


def test_max_logprobs_is_the_coordinators_limit():
    assert values_from_args(CoordinatorConfig, parse("--max-logprobs", "5")) == {"max_logprobs": 5}
    assert "max_logprobs" not in values_from_args(CoordinatorConfig, parse())


@pytest.mark.parametrize("f", [f for f in FLAGS if f.treatment == IGNORED], ids=lambda f: f.flag)
def test_an_ignored_flag_prints_one_warning_line_saying_why(capsys, f):
    value = () if f.argument.get("action") == "store_true" else ("x",)
    code, err = serve_stderr(capsys, MISSING, f.flag, *value)
    warnings = [line for line in err if f.flag in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"pdserve: warning: {f.flag} ignored: ")
    assert f.why in warnings[0]
    assert code == 2 and err[-1].startswith("pdserve: error: model directory")


def test_kv_transfer_config_names_pdserves_own_flags(capsys):
    _, err = serve_stderr(capsys, MISSING, "--kv-transfer-config", "{}")
    for flag in ("--transport", "--prefill-nodes", "--decode-nodes"):
        assert flag in err[0]


@pytest.mark.parametrize(
    "argv, instead",
    [
        (("-pp", "2"), "--tensor-parallel-size"),
        (("--pipeline-parallel-size", "4"), "--tensor-parallel-size"),
        (("-dp", "2"), "--prefill-nodes"),
        (("--data-parallel-size", "8"), "cluster file"),
    ],
)
def test_pipeline_or_data_parallelism_above_one_is_refused_in_one_line(capsys, argv, instead):
    code, err = serve_stderr(capsys, "pdserve-stories", *argv)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("pdserve: error: --") and instead in err[0]


def test_a_tokenizer_other_than_the_models_is_refused_and_the_models_own_accepted(capsys, tmp_path):
    code, err = serve_stderr(capsys, str(tmp_path / "m"), "--tokenizer", str(tmp_path / "t"))
    assert code == 2 and len(err) == 1 and "--tokenizer" in err[0]
    assert "reads the tokenizer from the model directory" in err[0]
    same = parse(str(tmp_path / "m"), "--tokenizer", str(tmp_path / "m" / "."))
    assert apply_vllm_flags(same, str(tmp_path / "m")) == []


def test_generation_config_auto_and_vllm_get_a_note_and_a_folder_a_warning():
    (auto,) = apply_vllm_flags(parse("--generation-config", "auto"), None)
    (vllm,) = apply_vllm_flags(parse("--generation-config", "vllm"), None)
    (folder,) = apply_vllm_flags(parse("--generation-config", "/some/dir"), None)
    assert auto.startswith("pdserve: note: ") and vllm.startswith("pdserve: note: ")
    assert folder.startswith("pdserve: warning: --generation-config /some/dir ignored")


def test_disable_log_flags_quiet_the_access_and_stats_lines():
    logs = [logging.getLogger(name) for name in ("pdserve.access", "pdserve.stats")]
    levels = [log.level for log in logs]
    try:
        assert apply_vllm_flags(parse("--disable-log-requests"), None) == []
        assert logs[0].level == logging.WARNING and logs[1].level == levels[1]
        apply_vllm_flags(parse("--disable-log-stats"), None)
        assert logs[1].level == logging.WARNING
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


def test_uvicorn_log_level_takes_vllms_names():
    assert parse("--uvicorn-log-level", "DEBUG").uvicorn_log_level == "debug"
    assert parse("--uvicorn-log-level", "trace").uvicorn_log_level == "trace"
    assert parse().uvicorn_log_level is None
    with pytest.raises(SystemExit):
        parse("--uvicorn-log-level", "loud")


def test_flags_given_as_one_and_accepted_print_nothing():
    args = parse("-pp", "1", "-dp", "1", "-tp", "1", "--max-logprobs", "3")
    assert apply_vllm_flags(args, None) == []


def test_uvicorn_log_level_sets_the_http_servers_logs():
    from fastapi import FastAPI

    from pdserve.coordinator.api_server import listen_socket, serve_http

    uvicorn_log = logging.getLogger("uvicorn.error")
    level = uvicorn_log.level

    async def serve_then_stop() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        await serve_http(FastAPI(), listen_socket("127.0.0.1", 0), stop, log_level="debug")

    try:
        asyncio.run(serve_then_stop())
        assert uvicorn_log.level == logging.DEBUG != logging.getLogger().level
    finally:
        uvicorn_log.setLevel(level)
