"""The GPU check kit without a GPU: its plan fits one device run, the pinned wheels and the host's
packages cover every import, the CUDA tests are found and run by the pytest plugin, the install
step installs with pip alone, a run without CUDA completes and says which steps it skipped and
why, and the report puts failures and the aims on its first screen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest

from pdserve.deploy.gpu_check import deps, env, gpu_tests, report
from pdserve.deploy.gpu_check.plan import BUDGET_S, LONG, MIN_STEP_S, QUICK, Step
from pdserve.deploy.gpu_check.runner import RunSettings, StepResult, run_step

REPO = Path(__file__).resolve().parents[1]
# The check's own limits: it ends within 10 minutes and writes a few plainly named files.
CHECK_LIMIT_S = 600
CHECK_FILES = 8
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


# --- the plan -----------------------------------------------------------------------------------


def test_each_plan_fits_one_device_run_with_room_for_start_and_report():
    for steps in (QUICK, LONG):
        assert sum(s.box_s for s in steps) <= BUDGET_S
        assert all(s.box_s >= MIN_STEP_S for s in steps)
    assert BUDGET_S + 45 <= CHECK_LIMIT_S


def test_quick_plan_runs_the_steps_in_the_issues_order_and_gpu_steps_need_cuda():
    order = "install env tests kernels tiles model_step moe quant_gemm serving parity speculative"
    order = order.split()
    assert [s.name for s in QUICK] == order
    assert all("cuda" in s.needs for s in QUICK[3:])
    # the tests step runs everywhere: without CUDA it lists the CUDA tests as not proven
    assert not QUICK[0].needs and not QUICK[1].needs and not QUICK[2].needs


# --- the wheels and the host --------------------------------------------------------------------


def test_pins_name_one_exact_version_of_each_wheel():
    pins = deps.read_pins()
    assert len({p.name for p in pins}) == len(pins) > 0
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!_-]*", p.version) for p in pins)


def test_a_pin_file_with_a_range_or_a_name_twice_is_refused(tmp_path: Path):
    ranged = tmp_path / "ranged.txt"
    ranged.write_text("pyzmq>=27\n")
    with pytest.raises(ValueError, match="not name==version"):
        deps.read_pins(ranged)
    twice = tmp_path / "twice.txt"
    twice.write_text("pyzmq==27.3.0\nPyZMQ==26.0.0  # again\n")
    with pytest.raises(ValueError, match="more than once: pyzmq"):
        deps.read_pins(twice)


def _provided() -> dict[str, str]:
    pins = deps.read_pins()
    return deps.host_import_names(deps.read_host()) | {
        m: f"wheel: {p.name}" for p in pins for m in deps.import_names(p.name)
    }


def test_every_import_of_the_code_is_on_the_gpu_host_or_in_the_wheels():
    assert deps.uncovered_imports(_provided()) == {}


def test_the_serving_packages_the_gpu_host_lacks_come_from_the_wheels():
    provided = _provided()
    for module in ("zmq", "msgspec", "fastapi", "starlette", "pydantic", "uvicorn", "setproctitle"):
        assert provided[module].startswith("wheel: "), module


def test_the_import_scan_sees_an_import_nothing_provides(tmp_path: Path):
    for folder in deps.SCANNED:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "engine" / "lazy.py").write_text("def f():\n    import orjson\n    import torch\n")
    assert deps.uncovered_imports(_provided(), tmp_path) == {"orjson": {"engine/lazy.py"}}


def test_pdserve_and_check_requirements_are_met_by_the_host_and_the_wheels():
    available = dict(deps.read_host()) | {p.name: p.version for p in deps.read_pins()}
    result = deps.check_requirements(deps.project_needs(), available)
    assert result.ok, result


def test_requirement_check_names_what_is_missing_too_old_or_unverifiable():
    needs = [
        ("a 1", "b>=2"),
        ("a 1", "c"),
        ("a 1", "cffi; implementation_name == 'pypy'"),
        ("a 1", "d>=1"),
        ("a 1", "e[extra]>=1,<3"),
        ("a 1", "f; python_version < '3.11'"),
    ]
    result = deps.check_requirements(needs, {"b": "1.5", "d": None, "e": "2.0"})
    assert result.missing == ["a 1 needs c"]
    assert result.conflicts == ["a 1 needs b>=2: b 1.5 is there"]
    assert result.unverified == ["a 1 needs d>=1: present, version unknown"]
    assert not result.ok


# --- the CUDA tests -----------------------------------------------------------------------------

CUDA_TESTS = """
import os
import pytest

hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""
needs_cuda = pytest.mark.skipif(hidden, reason="needs CUDA")


@needs_cuda
def test_on_gpu_passes():
    pass


@needs_cuda
def test_on_gpu_fails():
    assert 1 + 1 == 3, "wrong sum"


@needs_cuda
@pytest.mark.parametrize("n", [1, 2])
def test_on_gpu_param(n):
    pass


@pytest.mark.skipif(True, reason="needs 2 GPUs")
def test_needs_two_gpus():
    pass


def test_on_cpu():
    pass


@pytest.mark.skip(reason="never runs")
def test_never():
    pass
"""
MODULE_SKIP = """
import os
import pytest

if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
    pytest.skip("needs CUDA", allow_module_level=True)


def test_whole_module_on_gpu():
    pass
"""


def _pytest(tmp_path: Path, args: list[str], **env: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp_path),
        *gpu_tests.PLUGIN,
        *args,
    ]
    subprocess.run(cmd, cwd=tmp_path, env=_env(**env), capture_output=True, timeout=120)


def test_plugin_runs_exactly_the_tests_that_skip_without_cuda(tmp_path: Path):
    (tmp_path / "test_cuda.py").write_text(CUDA_TESTS)
    (tmp_path / "test_module.py").write_text(MODULE_SKIP)
    (tmp_path / "test_gpu_things.py").write_text("def test_unmarked():\n    pass\n")
    skips, events = tmp_path / "skips.json", tmp_path / "events.jsonl"
    hidden = ["--collect-only", "--cuda-skips-out", str(skips), "."]
    _pytest(tmp_path, hidden, CUDA_VISIBLE_DEVICES="")
    found = json.loads(skips.read_text())
    assert found["tests"] == {
        "test_cuda.py::test_on_gpu_passes": "needs CUDA",
        "test_cuda.py::test_on_gpu_fails": "needs CUDA",
        "test_cuda.py::test_on_gpu_param[1]": "needs CUDA",
        "test_cuda.py::test_on_gpu_param[2]": "needs CUDA",
        "test_cuda.py::test_needs_two_gpus": "needs 2 GPUs",
        "test_gpu_things.py::test_unmarked": "in a GPU test file",
    }
    assert found["skipped_modules"] == {"test_module.py": "needs CUDA"}

    # With the device visible: those alone run, each reported as it ends.
    visible = ["--cuda-select", str(skips), "--cuda-events", str(events), "."]
    _pytest(tmp_path, visible, CUDA_VISIBLE_DEVICES="0")
    tests = gpu_tests.outcomes(events)
    assert {k: v["outcome"] for k, v in tests.items()} == {
        "test_cuda.py::test_on_gpu_passes": "passed",
        "test_cuda.py::test_on_gpu_fails": "failed",
        "test_cuda.py::test_on_gpu_param[1]": "passed",
        "test_cuda.py::test_on_gpu_param[2]": "passed",
        "test_cuda.py::test_needs_two_gpus": "skipped",
        "test_module.py::test_whole_module_on_gpu": "passed",
        "test_gpu_things.py::test_unmarked": "passed",
    }
    failed = tests["test_cuda.py::test_on_gpu_fails"]
    assert failed["reason"].startswith("AssertionError: wrong sum")
    assert re.search(r"test_cuda\.py:\d+$", failed["where"])
    assert "assert 1 + 1 == 3" in failed["detail"]
    assert tests["test_cuda.py::test_needs_two_gpus"]["reason"] == "needs 2 GPUs"


# --- steps and the run --------------------------------------------------------------------------


def _wheel(folder: Path, name: str = "gpucheck_probe", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as whl:
        for arcname, text in files.items():
            whl.writestr(arcname, text)
    return path


def test_install_step_installs_with_pip_alone_and_names_wheels_off_the_pins(tmp_path: Path):
    wheels, site, record = tmp_path / "whl", tmp_path / "site", tmp_path / "install.json"
    wheels.mkdir()
    _wheel(wheels)
    cmd = [sys.executable, "-m", "pdserve.deploy.gpu_check.install", "--json", str(record)]
    cmd += ["--work", str(tmp_path), "--wheels", str(wheels), "--site", str(site)]
    subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, timeout=120, check=True)
    assert (site / "gpucheck_probe" / "__init__.py").read_text() == "VALUE = 42\n"
    saved = json.loads(record.read_text())
    assert saved["status"] == "failed"
    problems = [f["what"] for f in saved["failures"]]
    assert "gpucheck-probe 1.0 is there but not pinned" in problems
    assert any(p.startswith("pyzmq==") and "not in" in p for p in problems)
    assert "--no-index --no-deps" in saved["data"]["command"]


def test_a_run_without_cuda_completes_and_says_which_steps_it_skipped_and_why(tmp_path: Path):
    out, empty = tmp_path / "out", tmp_path / "no-wheels"
    empty.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.deploy.gpu_check",
        "--out",
        str(out),
        "--wheels",
        str(empty),
    ]
    env = _env(CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["logs.tar.gz", "report.md", "results.json"]
    assert len(files) <= CHECK_FILES and all(PLAIN_NAME.match(f) for f in files)

    steps = {s["name"]: s for s in json.loads((out / "results.json").read_text())["steps"]}
    assert list(steps) == [s.name for s in QUICK]
    assert steps["install"]["status"] == "skipped" and "no wheels in" in steps["install"]["summary"]
    assert steps["env"]["status"] == "passed"
    assert steps["env"]["data"]["facts"]["cuda"] is False
    for name in ("tests", "kernels", "tiles", "model_step", "serving", "parity", "speculative"):
        assert steps[name]["status"] == "skipped"
        assert steps[name]["summary"].startswith("no CUDA device"), steps[name]
    # every CUDA test of the suite is listed, as not proven here, with why
    listed = steps["tests"]["data"]["tests"]
    assert "tests/test_gpu_engine.py" in {n.split("::")[0] for n in listed}
    assert {t["outcome"] for t in listed.values()} == {"skipped"}

    text = (out / "report.md").read_text()
    assert text.startswith("# pdserve GPU check: NOTHING RAN ON A GPU")
    proof = f"\nCUDA tests: 0 proven, 0 failed or not run, {len(listed)} not proven here ("
    assert proof + f"{len(listed)}: no CUDA device" in text
    assert "| serving | skipped | 0 | no CUDA device" in text
    assert "not measured (model_step skipped: no CUDA device" in text
    assert done.stdout.rstrip().splitlines()[-1].startswith("wrote ")  # the first screen is last
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/env.log" in names and "env/record.json" in names


def _hanging_step(folder: Path, crash: bool) -> Step:
    """A step module that records a partial result, then hangs (or dies)."""
    ending = "os._exit(3)" if crash else "threading.Event().wait()"
    (folder / "hanging_step.py").write_text(
        textwrap.dedent(f"""
        import os, threading
        from pdserve.deploy.gpu_check.record import StepRecord, step_args
        args = step_args("hangs")
        record = StepRecord(args.json)
        record.data["half"] = "done"
        record.save()
        {ending}
    """)
    )
    return Step("hanging", "a step that never ends", "hanging_step", 5)


@pytest.mark.parametrize("crash", [False, True], ids=["hangs", "dies"])
def test_a_step_stopped_at_its_box_or_dying_fails_and_keeps_what_it_recorded(
    tmp_path: Path, crash: bool
):
    settings = RunSettings(work=tmp_path, wheels=tmp_path, site=tmp_path, budget_s=30)
    settings.logs.mkdir()
    step = _hanging_step(tmp_path, crash)
    result = run_step(step, settings, time.time() + step.box_s)
    assert result.status == ("failed" if crash else "timed out")
    assert result.data == {"half": "done"}
    assert result.failures and result.log == "logs/hanging.log"


# --- the report ---------------------------------------------------------------------------------


def _model_step_data() -> dict:
    """pdserve.bench.model_step's results as it writes them (its own dataclasses), graph the faster."""
    from pdserve.bench import model_step

    def decode(batch: int, context: int, gbps: float, fraction: float) -> dict:
        return asdict(model_step.DecodeStep(batch, context, 1.0, 2.0, 1.0, gbps, fraction))

    rows = [decode(1, 4096, 2766, 0.83), decode(64, 4096, 2100, 0.63), decode(256, 512, 2711, 0.81)]
    prefill = asdict(model_step.PrefillStep(1, 2048, 70.0, 33.0, 471.0, 0.6))
    return {
        "device": "NVIDIA H100",
        "preset": "llama3-8b",
        "dtype": "bfloat16",
        "copy_gbps": 3340.0,
        "matmul_tflops": 785.0,
        "decode": rows,
        "prefill": [prefill],
    }


def _kernels_data() -> dict:
    """pdserve.bench.kernels' results as it writes them."""
    from pdserve.bench import kernels

    decode = kernels.AttentionDecode(64, 4096, 400.0, 420.0, 9000.0, 1.07, 2684.0, 0.8)
    prefill = kernels.AttentionPrefill(1, 2048, 0.4, None, 0.14, 350.0, 0.45)
    return {
        "copy_gbps": 3340.0,
        "matmul_tflops": 785.0,
        "command": "python -m pdserve.bench.kernels",
        "decode": [asdict(decode)],
        "prefill": [asdict(prefill)],
    }


def test_first_screen_says_what_failed_where_and_each_aim_against_its_measure():
    test_id = "tests/test_gpu_engine.py::test_cuda_graph_decode_matches_cpu_reference[llama-False]"
    facts = {"devices": [{"name": "NVIDIA H100"}], "commit": "abc1234"}
    failed = {
        "outcome": "failed",
        "seconds": 3.0,
        "reason": "AssertionError: lists differ",
        "where": "tests/test_gpu_engine.py:91",
    }
    results = [
        StepResult("env", "env", "passed", summary="NVIDIA H100", data={"facts": facts}),
        StepResult(
            "tests",
            "tests",
            "failed",
            120,
            summary="55 passed, 1 failed",
            failures=[{"where": test_id, "what": "AssertionError: lists differ"}],
            data={"tests": {test_id: failed}},
        ),
        StepResult("kernels", "kernels", "passed", 30, data=_kernels_data()),
        StepResult("model_step", "model_step", "passed", 60, data=_model_step_data()),
        StepResult("serving", "serving", "timed out", 115, summary="stopped"),
    ]
    run = {
        "command": "python -m pdserve.deploy.gpu_check",
        "plan": "quick",
        "started": "now",
        "seconds": 300.0,
        "budget_s": 540.0,
    }
    screen = report.first_screen(run, results)
    assert len(screen) <= 40
    text = "\n".join(screen)
    # batch 64 at 63% of copy misses the decode aim, 2k prefill attention at 45% its aim
    missed = "2 aims missed: decode, prefill_attention"
    assert screen[0] == f"# pdserve GPU check: FAILED (2 of 5 steps: tests, serving; {missed})"
    assert report.failed(run, results)
    assert "NVIDIA H100" in screen[2] and "abc1234" in screen[2]
    assert f"`{test_id}`: AssertionError: lists differ" in text
    assert (
        "| batch 64, 4096 tokens (graph) | 63% (2100 of 3340 GB/s) | MISSED (1 of 2 cases" in text
    )
    assert "| batch 256, 512 tokens (graph) | 81% (2711 of 3340 GB/s) | met (1 of 1 cases" in text
    assert "| 1 x 2048 tokens | 60% (471 of 785 TFLOP/s) | met (1 of 1 cases met) |" in text
    assert "batch 1," not in text  # the aim is for batches of 64 and more
    full = report.render(run, results)
    assert full.startswith(text) and "tests/test_gpu_engine.py:91" in full
    assert "| batch 256, 512 tokens (graph) | 81% (2711 of 3340 GB/s) | 0.7 | met |" in full
    assert "batch 1," not in full
    assert "| 64 | 4096 | 400.0 | 420.0 | 9000.0 | 2684 | 80% |" in full  # kernels' table
    assert "| 1 | 2048 | portable | 0.40 | - | - | 350 | 45% |" in full
    assert "(details incomplete" not in full


def test_the_quant_gemm_details_compare_each_kernel_with_cublas_and_show_a_difference():
    from pdserve.bench.quant_gemm import TOLERANCE, _row

    # 2 x 4096 x 4096 FLOPs; W4A16 reads 4096 x 4096 / 2 bytes of weights (plus scales).
    rows = [
        _row("w4a16", [4096, 4096], 1, 10.0, 20.0, 8.5e6, 2.0 * 4096 * 4096, 4e-3),
        _row("fp8_block", [4096, 4096], 2048, 500.0, 400.0, 1.7e7, 2.0 * 2048 * 4096**2, 0.2),
    ]
    assert rows[0]["equal"] and not rows[1]["equal"]
    assert rows[1]["tolerance"] == TOLERANCE["gemm"]
    data = {"device": "NVIDIA H200", "capability": [9, 0], "command": "bench", "rows": rows}
    result = StepResult("quant_gemm", "quant_gemm", "failed", 30, summary="s", data=data)
    run = {"command": "c", "plan": "quick", "started": "now", "seconds": 1.0, "budget_s": 540.0}
    text = report.render(run, [result])
    assert "(details incomplete" not in text
    assert "| w4a16 | 4096x4096 | 1 | 10.0 | 20.0 | 2.00 | 850 | 3.4 | yes (4.0e-03) |" in text
    assert (
        "| fp8_block | 4096x4096 | 2048 | 500.0 | 400.0 | 0.80 | 34 | 137.4 | NO (2.0e-01) |"
        in text
    )


def test_the_first_screen_counts_what_the_cuda_tests_proved_and_what_one_gpu_cannot():
    """A skip is not a pass and a selected test that never reported is a failure: the report's
    second line says how many tests proved their path, failed, or could not run on this host
    and why; the tests step fails on a test that never reported."""
    nccl, two = "nccl needs CUDA with 2 device(s) and CuPy", "needs 2 CUDA devices"
    tests = {
        "t::a": {"outcome": "passed", "seconds": 1.0},
        "t::b": {"outcome": "passed", "seconds": 1.0},
        "t::c": {"outcome": "skipped", "seconds": 0.0, "reason": nccl},
        "t::d": {"outcome": "skipped", "seconds": 0.0, "reason": nccl},
        "t::e": {"outcome": "skipped", "seconds": 0.0, "reason": two},
        "t::f": {"outcome": "not run", "seconds": 0.0},
        "t::g": {"outcome": "failed", "seconds": 2.0, "reason": "AssertionError", "where": "t:9"},
    }
    assert gpu_tests.failures(tests) == [
        {"where": "t::f", "what": "selected but did not run"},
        {"where": "t::g", "what": "AssertionError (t:9)"},
    ]
    results = [StepResult("tests", "tests", "failed", 60, data={"tests": tests})]
    run = {"command": "c", "plan": "quick", "started": "now", "seconds": 60.0, "budget_s": 540.0}
    screen = report.first_screen(run, results)
    assert screen[4] == (
        f"CUDA tests: 2 proven, 2 failed or not run, 3 not proven here (2: {nccl}; 1: {two})"
    )
    assert screen[5].startswith("Aims: 0 met, 0 missed, ")  # beside them, what the aims got
    # and the command that proves them where there are GPUs enough
    assert (
        screen[7].startswith("Not proven for want of GPUs (3 tests") and "with 2 GPUs" in screen[7]
    )
    assert "`python -m pdserve.deploy.gpu_check --out OUT --only install,env,tests`" in screen[7]
    skipped = [StepResult("tests", "tests", "skipped", summary="no CUDA device: hidden")]
    assert report.proof(skipped) == "CUDA tests: none proven here (no CUDA device: hidden)"
    # A serving transport the host cannot run (no CuPy for cuda_ipc) is named as not proven,
    # not passed over.
    serving = StepResult(
        "serving",
        "serving",
        "passed",
        60,
        data={"not_proven": {"cuda_ipc": "CuPy is not importable"}},
    )
    assert report.proof(results + [serving]).endswith(
        "). Serving not proven here: cuda_ipc (CuPy is not importable)"
    )
    assert "Serving" not in report.proof(results + [StepResult("serving", "serving", "passed")])


def test_a_gpu_that_nvidia_smi_lists_and_torch_cannot_use_fails_the_check(monkeypatch):
    from pdserve.deploy.gpu_check.env import gpu_unusable, gpus_listed

    smi = "NVIDIA H200, 580.159.04, 143771 MiB, 345 MHz, 3201 MHz"
    assert gpus_listed(smi + "\n" + smi) == 2
    assert gpus_listed("unavailable: [Errno 2] No such file or directory: 'nvidia-smi'") == 0
    facts = {"nvidia_smi": smi, "cuda": False, "cuda_why": "torch.cuda.is_available() is False"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_unusable(facts) == (
        "nvidia-smi lists 1 GPU(s) but torch cannot use them: torch.cuda.is_available() is False"
    )
    assert gpu_unusable({**facts, "cuda": True}) is None
    assert gpu_unusable({**facts, "nvidia_smi": "unavailable: no driver"}) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose
    assert gpu_unusable(facts) is None


def test_the_commit_says_how_many_files_differ_from_it(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("out/\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert env.commit(tmp_path) == head  # the checkout is the commit
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.md").write_text("ignored\n")
    assert env.commit(tmp_path) == f"{head} + 2 uncommitted files"  # modified and new, not ignored
    assert env.commit(tmp_path / "nowhere") == "unknown (no git checkout)"


def test_the_parity_step_runs_on_cpu_up_to_its_first_cuda_call(tmp_path, monkeypatch):
    """The step's own code on this machine: with the device boundary faked (torch believes a GPU
    is there), it builds the first checkpoint and transformers' greedy reference, and stops at
    the first CUDA call, the engine's load onto the GPU."""
    import torch

    from pdserve.deploy.gpu_check import parity

    if torch.cuda.is_available():
        pytest.skip("a real GPU: the check itself runs this step")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []
    real = parity.generate

    def generate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[1:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(parity, "generate", generate)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        parity.main(["--json", str(tmp_path / "parity.json"), "--work", str(tmp_path)])
    assert calls == [("triton", parity.CASES[0][1])]  # the first engine, on the GPU
    family = parity.CASES[0][0]
    assert (tmp_path / family / "config.json").is_file()  # its checkpoint was built


def test_the_serving_steps_float32_yardstick_tells_rounding_from_a_wrong_token(tmp_path):
    """The serving step checks its bfloat16 outputs against float32 (not against themselves):
    float32's own greedy tokens sit 0 nats below its best, random tokens far beyond the
    tolerance. Run on CPU, the step's function itself."""
    import random

    from checkpoints import build_checkpoint, hf_greedy

    from pdserve.deploy.gpu_check.serving import BF16_TOLERANCE_NATS, float32_gaps

    model = build_checkpoint("llama", tmp_path / "llama")
    prompts = [[5, 9, 17, 33, 2], list(range(40, 80))]
    greedy = hf_greedy(model, prompts, 8)
    assert max(float32_gaps(model, prompts, greedy, device="cpu")) < 1e-5
    rng = random.Random(0)
    vocab = 100  # within every tiny checkpoint's vocabulary
    wrong = [[rng.randrange(vocab) for _ in out] for out in greedy]
    gaps = float32_gaps(model, prompts, wrong, device="cpu")
    assert sorted(gaps)[len(gaps) // 2] > BF16_TOLERANCE_NATS


@pytest.mark.parametrize(
    "module, argv",
    [
        ("bench_steps", ["kernels"]),
        ("bench_steps", ["model_step"]),
        ("bench_steps", ["moe"]),
        ("bench_steps", ["quant_gemm"]),
        ("tiles", []),
        ("serving", []),
    ],
)
def test_each_gpu_steps_code_runs_on_cpu_up_to_its_first_cuda_call(
    tmp_path, monkeypatch, module, argv
):
    """With the device boundary faked (torch believes a GPU is there), each step's own code runs
    until CUDA itself refuses: what breaks is the missing GPU, not a name, a type or an import."""
    import importlib

    import torch

    if torch.cuda.is_available():
        pytest.skip("a real GPU: the check itself runs this step")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    step = importlib.import_module(f"pdserve.deploy.gpu_check.{module}")
    record = tmp_path / "record.json"
    try:
        code = step.main([*argv, "--json", str(record), "--work", str(tmp_path)])
        why = json.loads(record.read_text())["failures"][0]["what"]
    except Exception as exc:  # noqa: BLE001 (the steps without a catch-all raise)
        code, why = 1, f"{type(exc).__name__}: {exc}"
    assert code == 1
    assert re.search(r"CUDA|cuda|NVIDIA", why) and not re.match(
        r"(Name|Type|Import|Attribute)Error", why
    ), why
