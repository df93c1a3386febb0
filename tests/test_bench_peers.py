"""The peer benchmark without the peer: what passes between the benchmark and a round's runner
(requests, arguments, the result line), the vLLM runner's options and script start, the order of
the rounds and the table of medians and ratios, the competing load, pdserve's runner end to end on
pdserve-tiny, and the one-line error when vLLM's virtualenv is missing. vLLM itself is not
installed here (`make bench-peers` makes it for the benchmark alone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.peers import driver, models, pdserve_runner, vllm_runner
from pdserve.bench.peers.competing_load import CompetingLoad
from pdserve.bench.peers.protocol import (
    RESULT_PREFIX,
    RoundRequest,
    RoundResult,
    machine_cpu_seconds,
    parse_result,
    parse_runner_args,
    read_requests,
    result_line,
    runner_argv,
    write_requests,
)
from pdserve.bench.peers.rounds import (
    Run,
    docs_table,
    median_tokens_per_s,
    ratio,
    round_order,
    summary,
    table,
)
from pdserve.bench.peers.variants import (
    DEFAULT,
    Variant,
    engine_options,
    parse_variant,
    parse_variants,
)
from pdserve.engine.embedded.tiny import ensure_tiny_model

REPO = Path(__file__).resolve().parent.parent


def result(engine: str, tok_s: float, elapsed_s: float = 2.0) -> RoundResult:
    # 3 s of the engine's CPU time, 4 s of the whole machine's: 1 s went to other work.
    return RoundResult(engine, elapsed_s, round(tok_s * elapsed_s), 3.0, "1.0", 1, 4.0)


# --- protocol -----------------------------------------------------------------------------------


def test_the_machines_busy_time_leaves_out_idle_and_iowait():
    ticks = os.sysconf("SC_CLK_TCK")
    line = f"cpu  {ticks} 0 {ticks} {100 * ticks} {50 * ticks} 0 0 {ticks} 0 0"
    assert machine_cpu_seconds(line) == pytest.approx(3.0)
    assert machine_cpu_seconds() > 0  # this machine's, since boot


def test_requests_round_trip_through_the_file(tmp_path):
    requests = [RoundRequest([5, 6, 7], 4), RoundRequest([9] * 20, 33)]
    write_requests(tmp_path / "r.json", requests)
    assert read_requests(tmp_path / "r.json") == requests


def test_runner_arguments_parse_back_to_what_was_asked(tmp_path):
    argv = runner_argv(tmp_path / "model", tmp_path / "r.json", max_num_seqs=64, block_size=32)
    args = parse_runner_args(argv)
    assert (args.model, args.requests) == (tmp_path / "model", tmp_path / "r.json")
    assert (args.max_num_seqs, args.block_size) == (64, 32)


def test_the_last_result_line_is_read_among_the_engines_own_output():
    first, last = result("vllm", 100.0), result("vllm", 250.0)
    stdout = "\n".join(["INFO loading", result_line(first), "WARNING noise", result_line(last)])
    got = parse_result(stdout + "\nshutdown\n")
    assert got == last and got.tokens_per_s == pytest.approx(250.0)
    with pytest.raises(ValueError, match="no result line"):
        parse_result("INFO only logs\n")


def test_vllm_gets_its_defaults_but_float32_token_ids_and_the_shared_batch_cap(tmp_path):
    args = parse_runner_args(runner_argv(tmp_path, tmp_path / "r.json", 128, 16))
    opts = vllm_runner.engine_options(args)
    assert opts["dtype"] == "float32" and opts["skip_tokenizer_init"] is True
    assert opts["max_num_seqs"] == 128 and opts["model"] == str(tmp_path)
    # vLLM's compilation and thread binding are what is compared: nothing overrides them.
    assert not {"enforce_eager", "compilation_config", "block_size"} & set(opts)


def test_the_vllm_runner_starts_as_a_script_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, str(driver.VLLM_RUNNER), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "--requests" in res.stdout and "--max-num-seqs" in res.stdout


# --- rounds -------------------------------------------------------------------------------------


def test_rounds_alternate_which_engine_goes_first():
    assert round_order(["pdserve", "vllm"], 3) == [
        ["pdserve", "vllm"],
        ["vllm", "pdserve"],
        ["pdserve", "vllm"],
    ]
    with pytest.raises(ValueError):
        round_order(["pdserve", "vllm"], 0)


def rounds_of(pdserve: list[float], vllm: list[float], load: float = 0.5) -> list[Run]:
    runs = []
    for i, (a, b) in enumerate(zip(pdserve, vllm, strict=True), start=1):
        runs += [Run(i, result("pdserve", a), load, 2), Run(i, result("vllm", b), load + 1, 2)]
    return runs


def test_medians_and_the_ratio_of_the_medians():
    runs = rounds_of([100.0, 300.0, 200.0], [100.0, 400.0, 100.0])
    assert median_tokens_per_s(runs, "pdserve") == pytest.approx(200.0)
    assert median_tokens_per_s(runs, "vllm") == pytest.approx(100.0)
    assert ratio(runs, "pdserve", "vllm") == pytest.approx(2.0)
    s = summary(runs, "pdserve", "vllm")
    assert s["pdserve_tok_s"] == pytest.approx([100.0, 300.0, 200.0])
    assert s["load_1m"] == [0.5, 1.5]


def test_the_table_has_a_row_per_round_and_the_medians():
    runs = rounds_of([100.0, 300.0, 200.0], [100.0, 400.0, 100.0], load=1.0)
    lines = table(runs, "pdserve", "vllm").splitlines()
    assert lines[0].startswith("| round | pdserve tok/s | vLLM tok/s | pdserve / vLLM |")
    assert len(lines) == 2 + 3 + 1
    assert lines[2].startswith("| 1 | 100.0 | 100.0 | 1.00x |")
    assert lines[3].startswith("| 2 | 300.0 | 400.0 | 0.75x |") and "| 1.0-2.0 |" in lines[3]
    # CPU share: 3 s of CPU over 2 s on 2 cores; the other 1 s of the machine's, 25%.
    assert "| 75% | 75% | 25%, 25% |" in lines[2]
    assert lines[-1] == "| **median** | **200.0** | **100.0** | **2.00x** | | | | |"


def test_the_docs_table_of_a_results_file_is_the_table_of_its_rounds():
    runs = rounds_of([100.0, 300.0, 200.0], [100.0, 400.0, 100.0], load=1.0)
    rounds = [
        {"round": r.round, "load_1m": r.load_1m}
        | {k: getattr(r.result, k) for k in RoundResult.__slots__}
        for r in runs
    ]
    results = {"machine": {"cores": 2}, "peer": "vllm", "rounds": rounds}
    assert docs_table(results) == table(runs, "pdserve", "vllm")


# --- pdserve's variants -------------------------------------------------------------------------


def test_a_variant_is_a_label_and_engine_flags():
    v = parse_variant("one-bound=--cpu-threads 1 --cpu-bind 0 --compile")
    assert parse_variant("t=--cpu-linear torch").flags == ("--cpu-linear", "torch")
    assert v == Variant("one-bound", ("--cpu-threads", "1", "--cpu-bind", "0", "--compile"))
    assert parse_variant("eager=--no-compile").flags == ("--no-compile",)
    assert parse_variants(["a=--cpu-threads 2"], "vllm") == [
        DEFAULT,
        Variant("a", ("--cpu-threads", "2")),
    ]


@pytest.mark.parametrize(
    "spec, why",
    [
        ("--cpu-threads 1", "LABEL=FLAGS"),
        ("two words=--compile", "LABEL=FLAGS"),
        ("x=--max-num-seqs 4", "not an engine flag"),
        ("x=--cpu-threads one", "invalid int value"),
    ],
)
def test_a_bad_variant_says_what_is_wrong_in_one_line(spec, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_variant(spec)
    assert "\n" not in str(e.value)


def test_variant_labels_are_unique_and_apart_from_the_peer():
    with pytest.raises(ValueError, match="used twice"):
        parse_variants(["a=", "a=--compile"], "vllm")
    with pytest.raises(ValueError, match="used twice"):
        parse_variants(["vllm=--compile"], "vllm")
    with pytest.raises(ValueError, match="used twice"):
        parse_variants(["pdserve=--compile"], "vllm")


def test_rounds_alternate_over_every_variant_and_the_peer():
    order = round_order(["pdserve", "one-bound", "vllm"], 2)
    assert order == [["pdserve", "one-bound", "vllm"], ["vllm", "one-bound", "pdserve"]]


def test_offline_throughput_refuses_a_bad_variant_before_running_anything(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.bench.offline_throughput",
        "--peer",
        "vllm",
        "--peer-venv",
        str(venv),
        "--pdserve-variant",
        "x=--max-num-seqs 4",
    ]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "is not an engine flag" in res.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["venv"]


# --- the processes ------------------------------------------------------------------------------


def test_each_engine_runs_with_its_own_interpreter(tmp_path):
    venv = tmp_path / "venv"
    cmd = driver.runner_command("vllm", tmp_path, tmp_path / "r.json", 256, 16, venv)
    assert cmd[:2] == [str(venv / "bin" / "python"), str(driver.VLLM_RUNNER)]
    cmd = driver.runner_command("pdserve", tmp_path, tmp_path / "r.json", 256, 16, venv)
    assert cmd[:3] == [sys.executable, "-m", "pdserve.bench.peers.pdserve_runner"]
    assert pdserve_runner.parse_args(cmd[3:]).model == tmp_path
    assert "PYTHONPATH" not in driver.runner_env("vllm")
    assert driver.runner_env("pdserve")["PYTHONPATH"] == str(REPO)
    variant = Variant("one-bound", ("--cpu-threads", "1", "--cpu-bind", "0"))
    cmd = driver.runner_command("pdserve", tmp_path, tmp_path / "r.json", 256, 16, venv, variant)
    args = pdserve_runner.parse_args(cmd[3:])
    assert (args.label, args.cpu_threads, args.cpu_bind, args.compile) == (
        "one-bound",
        1,
        "0",
        None,
    )
    # The flags a variant gives become EngineConfig options; the rest keep the defaults.
    fixed = Variant("fixed", ("--no-cpu-adaptive-threads", "--cpu-linear", "torch"))
    cmd = driver.runner_command("pdserve", tmp_path, tmp_path / "r.json", 256, 16, venv, fixed)
    assert engine_options(pdserve_runner.parse_args(cmd[3:])) == {
        "cpu_adaptive_threads": False,
        "cpu_linear": "torch",
    }


def test_a_missing_peer_virtualenv_names_the_make_target(tmp_path):
    why = driver.missing_peer("vllm", tmp_path / "none")
    assert why is not None and "make bench-peers" in why and "\n" not in why
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    assert driver.missing_peer("vllm", tmp_path / "venv") is None


def test_offline_throughput_peer_without_the_venv_is_a_one_line_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "pdserve.bench.offline_throughput",
        "--peer",
        "vllm",
        "--peer-venv",
        str(tmp_path / "none"),
    ]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve.bench.offline_throughput: error: ")
    assert "make bench-peers" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_competing_load_runs_only_inside_its_block():
    with CompetingLoad(1) as load:
        (proc,) = load.procs
        assert proc.poll() is None
    assert proc.poll() is not None
    with pytest.raises(ValueError):
        CompetingLoad(-1)


def test_pdserve_round_runner_end_to_end(tmp_path):
    """The real runner process on pdserve-tiny: every requested token, one result line. Enough
    tokens that the run outlasts /proc/stat's 10 ms ticks many times over: 9 tokens took 8 ms
    once, and the machine's CPU time read 0."""
    requests = [RoundRequest([5, 6, 7, 8], 240), RoundRequest([9, 10], 120)]
    write_requests(tmp_path / "r.json", requests)
    cmd = driver.runner_command("pdserve", ensure_tiny_model(), tmp_path / "r.json", 8, 16)
    env = {**driver.runner_env("pdserve"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert sum(ln.startswith(RESULT_PREFIX) for ln in res.stdout.splitlines()) == 1
    got = parse_result(res.stdout)
    assert (got.engine, got.output_tokens) == ("pdserve", 360)
    assert got.elapsed_s > 0 and got.machine_cpu_s > 0


def test_a_pdserve_variant_runs_with_its_engine_flags(tmp_path):
    """A variant's round: the engine takes its flags (one thread here) and the result its label."""
    write_requests(tmp_path / "r.json", [RoundRequest([5, 6, 7, 8], 5)])
    variant = parse_variant("one=--cpu-threads 1")
    cmd = driver.runner_command(
        "pdserve", ensure_tiny_model(), tmp_path / "r.json", 8, 16, variant=variant
    )
    res = subprocess.run(
        cmd, env=driver.runner_env("pdserve"), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    got = parse_result(res.stdout)
    assert (got.engine, got.output_tokens, got.threads) == ("one", 5, 1)


# --- checkpoints --------------------------------------------------------------------------------


def test_every_bench_model_has_head_dim_32_or_more():
    # vLLM's CPU attention refuses head_dim 16.
    for name in models.MODELS:
        assert models.config_of(name)["head_dim"] >= 32, name
    with pytest.raises(ValueError, match="unknown bench model"):
        models.config_of("llama-1t")


def test_the_small_llama_is_built_with_transformers_at_its_stated_size(tmp_path):
    from safetensors import safe_open

    out = models.build("llama-9m", tmp_path / "m")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        count = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    assert count == models.num_parameters(models.config_of("llama-9m"))
    assert 8e6 < count < 10e6
    assert (out / "tokenizer.json").is_file()
    assert models.resolve(str(out)) == out
    with pytest.raises(ValueError, match="neither a bench model"):
        models.resolve(str(tmp_path / "nothing"))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- vLLM's server in bench.compare -------------------------------------------------------------


def test_compare_starts_vllms_openai_server_from_its_venv(tmp_path):
    from pdserve.bench.serving.vllm_server import VllmServer

    server = VllmServer(tmp_path, "/m", max_num_seqs=64, venv=tmp_path / "venv")
    server.work_dir.mkdir(parents=True)
    cmd = server.launch_command()
    assert cmd[:3] == [
        str(tmp_path / "venv/bin/python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert flags["--model"] == "/m" and flags["--port"] == str(server.port)
    assert (flags["--dtype"], flags["--max-num-seqs"]) == ("float32", "64")
    # vLLM's own thread binding: not pdserve nodes' one thread per process.
    assert "PYTHONPATH" not in server.env
    assert server.env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")


def test_compare_with_vllm_but_no_venv_is_a_one_line_error(tmp_path):
    from pdserve.bench import compare

    with pytest.raises(SystemExit) as exc:
        compare.main(["--systems", "vllm", "--peer-venv", str(tmp_path / "none")])
    message = str(exc.value)
    assert message.startswith("pdserve.bench.compare: error: ") and "make bench-peers" in message
    assert "\n" not in message
