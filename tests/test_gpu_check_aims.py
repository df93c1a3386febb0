"""The GPU check's aims fail it on a miss: each measured figure below its aim makes the run exit 1
(after writing every file), one at its aim passes, and an aim whose figure was not measured is
counted apart and never passes. The report names the exact tree that ran: commit plus a hash of
its changes, from git or from a stamp written before the tree travelled."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest

from pdserve.deploy.gpu_check import __main__ as check
from pdserve.deploy.gpu_check import aims, report, tree
from pdserve.deploy.gpu_check.plan import QUICK, Step
from pdserve.deploy.gpu_check.runner import StepResult

RUN = {"command": "c", "plan": "quick", "started": "now", "seconds": 1.0, "budget_s": 540.0}
# Each aim's figure just at its threshold: every aim met.
AT_AIM = {a.key: a.threshold for a in aims.AIMS}
BELOW = 0.999  # a figure this fraction of its aim misses it


def _records(values: dict[str, float]) -> dict[str, dict]:
    """Each measuring step's data as its benchmark writes it, every aim's figure set from
    `values`; beside them cases outside every aim (batch 1, 64 tokens of MoE, other row counts)
    with figures far below, which no aim may read."""
    from pdserve.bench import kernels, model_step, moe
    from pdserve.bench.quant_gemm import _row

    def decode(batch: int, context: int, fraction: float) -> dict:
        gbps = 4000.0 * fraction
        return asdict(model_step.DecodeStep(batch, context, 1.0, 2.0, 1.0, gbps, fraction))

    model = {
        "copy_gbps": 4000.0,
        "matmul_tflops": 800.0,
        "decode": [
            decode(1, 4096, 0.05),
            decode(64, 4096, values["decode"]),
            decode(256, 512, values["decode_large"]),
        ],
        "prefill": [
            asdict(model_step.PrefillStep(1, 512, 1.0, 1.0, 8.0, 0.01)),
            asdict(model_step.PrefillStep(1, 2048, 1.0, 1.0, 400.0, values["prefill_step"])),
        ],
    }
    attention = values["prefill_attention"]
    kernel = {
        "copy_gbps": 4000.0,
        "matmul_tflops": 800.0,
        "decode": [],
        "prefill": [
            asdict(kernels.AttentionPrefill(1, 2048, 1.0, None, 0.5, 800 * attention, attention)),
            asdict(kernels.AttentionPrefill(1, 16384, 1.0, None, 9.0, 8.0, 0.01)),
        ],
    }

    def moe_row(tokens: int, fraction: float) -> dict:
        return asdict(
            moe.Row(
                tokens, 1.0, None, {"triton": 1.0}, 8, 0.1, {"triton": 0.5}, {"triton": fraction}
            )  # fmt: skip
        )

    experts = {
        "copy_gbps": 4000.0,
        "matmul_tflops": 800.0,
        "rows": [moe_row(1, values["moe_small"]), moe_row(64, 0.01)],
    }

    def gemm(kernel: str, rows: int, speedup: float) -> dict:
        # `speedup` is cuBLAS bf16's time over the kernel's: 1 µs against `speedup` µs.
        return _row(kernel, [4096, 4096], rows, 1.0, speedup, 1e6, 1e6, 1e-3)

    quant = {
        "rows": [
            gemm("w4a16", 1, values["w4a16_decode"]),
            gemm("w4a16", 2048, 0.1),
            gemm("w8a16_block", 1, values["w8a16_decode"]),
            gemm("fp8_block", 1, 0.1),
            gemm("fp8_block", 2048, values["fp8_prefill"]),
            gemm("moe_fp8", 1, values["moe_fp8_decode"]),
            gemm("moe_fp8", 2048, 0.1),
        ]
    }
    identity = {"identical_tokens": round(1000 * values["speculative_identity"]), "tokens": 1000}
    return {
        "model_step": model,
        "kernels": kernel,
        "moe": experts,
        "quant_gemm": quant,
        "speculative": identity,
    }


def _results(values: dict[str, float]) -> list[StepResult]:
    return [StepResult(n, n, "passed", 1.0, data=d) for n, d in _records(values).items()]


def _verdicts(values: dict[str, float]) -> dict[str, str]:
    rows = report.verdicts(RUN, _results(values))
    return {a.key: aims.outcome(rows, a.key) for a in aims.AIMS}


def test_every_aim_at_its_threshold_is_met_and_the_run_passes():
    assert set(_verdicts(AT_AIM).values()) == {aims.MET}
    assert not report.failed(RUN, _results(AT_AIM))
    assert report.headline(RUN, _results(AT_AIM)) == "PASSED"
    rows = report.verdicts(RUN, _results(AT_AIM))
    assert aims.count_line(rows).startswith(f"Aims: {len(aims.AIMS)} met, 0 missed, 0 not measured")


@pytest.mark.parametrize("key", [a.key for a in aims.AIMS])
def test_a_figure_below_its_aim_misses_it_and_fails_the_run(key: str):
    values = AT_AIM | {key: AT_AIM[key] * BELOW}
    outcomes = _verdicts(values)
    assert outcomes.pop(key) == aims.MISSED
    assert set(outcomes.values()) == {aims.MET}  # the others still met, read from their own cases
    results = _results(values)
    assert report.failed(RUN, results)
    assert report.headline(RUN, results) == f"FAILED (1 aim missed: {key})"
    screen = "\n".join(report.first_screen(RUN, results))
    assert f"Aims: {len(aims.AIMS) - 1} met, 1 missed, 0 not measured" in screen
    assert screen.count("| MISSED (") == 1 and "| met (" in screen


def test_an_aim_not_measured_is_counted_apart_and_never_passes():
    records = _records(AT_AIM)
    w4a16_gone = {"rows": [r for r in records["quant_gemm"]["rows"] if r["kernel"] != "w4a16"]}
    no_figure = {"rows": [{k: v for k, v in r.items() if k != "fraction_of_copy"}
                          for r in records["moe"]["rows"]]}  # fmt: skip
    results = [
        StepResult("model_step", "model_step", "skipped", summary="no CUDA device"),
        StepResult("kernels", "kernels", "failed", 3.0, summary="kernels broke"),
        StepResult("moe", "moe", "passed", 1.0, data=no_figure),
        StepResult("quant_gemm", "quant_gemm", "passed", 1.0, data=w4a16_gone),
    ]
    rows = report.verdicts(RUN, results)
    outcomes = {a.key: aims.outcome(rows, a.key) for a in aims.AIMS}
    measured = {"w8a16_decode", "fp8_prefill", "moe_fp8_decode"}
    assert {k for k, v in outcomes.items() if v == aims.MET} == measured
    assert aims.tally(rows) == {aims.MET: 3, aims.NOT_MEASURED: len(aims.AIMS) - 3}
    why = {r.key: r.verdict for r in rows if r.value is None}
    assert why["decode"] == "not measured (model_step skipped: no CUDA device)"
    assert why["prefill_attention"] == "not measured (kernels failed: kernels broke)"
    assert why["moe_small"].startswith("not measured (moe's record lacks its figure (KeyError")
    assert why["w4a16_decode"] == "not measured (quant_gemm measured no case it covers)"
    assert why["speculative_identity"] == "not measured (speculative did not run)"
    # not measured is no miss: only the failed step fails this run
    assert report.headline(RUN, results) == "FAILED (1 of 4 steps: kernels)"
    assert not report.failed(RUN, [r for r in results if r.name != "kernels"])
    # a step of the plan left out of the run (--only) did not run; the aims read the plan's steps
    assert {a.step for a in aims.AIMS} <= {s.name for s in QUICK}


def _recorded_step(site: Path, name: str, data: dict) -> Step:
    """A step module that records `data` as its benchmark would, for the runner to run."""
    (site / f"recorded_{name}.py").write_text(
        textwrap.dedent(f"""
        from pdserve.deploy.gpu_check.record import StepRecord, step_args
        args = step_args("recorded")
        record = StepRecord(args.json)
        record.data = {data!r}
        record.finish("recorded figures")
    """)
    )
    return Step(name, f"recorded {name}", f"recorded_{name}", 30)


@pytest.mark.parametrize("below", [True, False], ids=["missed", "met"])
def test_the_check_exits_1_on_a_missed_aim_after_writing_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, below: bool
):
    site, out = tmp_path / "site", tmp_path / "out"
    site.mkdir()
    values = AT_AIM | ({"decode_large": 0.74} if below else {})
    steps = (_recorded_step(site, "model_step", _records(values)["model_step"]),)
    monkeypatch.setattr(check, "plan", lambda long: steps)
    argv = ["--out", str(out), "--site", str(site), "--wheels", str(tmp_path), "--budget-s", "60"]
    assert check.main(argv) == (1 if below else 0)
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "report.md", "results.json"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["steps"][0]["status"] == "passed"  # the step ran well; its figure missed
    large = [v for v in saved["aims"] if v["key"] == "decode_large"]
    assert [v["verdict"] for v in large] == ["MISSED" if below else "met"]
    first = (out / "report.md").read_text().splitlines()[0]
    assert first == ("# pdserve GPU check: " + ("FAILED (1 aim missed: decode_large)" if below
                                               else "PASSED"))  # fmt: skip
    assert saved["run"]["tree"]["label"] in (out / "report.md").read_text()


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("out/\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return repo


def test_the_tree_is_the_commit_plus_a_hash_that_changes_with_the_diff(checkout: Path):
    head = _git(checkout, "rev-parse", "HEAD")
    clean = tree.tree(checkout)
    assert clean["label"] == head[: tree.SHORT] and clean["source"] == "git"
    (checkout / "a.py").write_text("x = 2\n")
    two = tree.tree(checkout)
    (checkout / "a.py").write_text("x = 3\n")
    three = tree.tree(checkout)
    assert two["diff_sha256"] != three["diff_sha256"]
    assert three["label"] == f"{head[: tree.SHORT]} + diff {three['diff_sha256'][:12]} (1 file)"
    (checkout / "a.py").write_text("x = 2\n")
    assert tree.tree(checkout)["diff_sha256"] == two["diff_sha256"]  # the same diff, the same hash
    (checkout / "b.py").write_text("y = 1\n")  # untracked: it travels, so it counts
    new = tree.tree(checkout)
    assert new["diff_sha256"] != two["diff_sha256"] and new["changed_files"] == 2
    (checkout / "out").mkdir()
    (checkout / "out" / "report.md").write_text("ignored\n")  # ignored: it does not travel
    assert tree.tree(checkout)["diff_sha256"] == new["diff_sha256"]


def test_a_stamp_names_the_tree_where_the_files_travel_without_git(checkout: Path, tmp_path):
    (checkout / "a.py").write_text("x = 2\n")
    here = tree.tree(checkout)
    tree.write_stamp(checkout)
    assert tree.tree(checkout)["label"] == here["label"]  # the stamp does not stamp itself
    copy = tmp_path / "device"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    there = tree.tree(copy)
    assert there["label"] == here["label"] and there["diff_sha256"] == here["diff_sha256"]
    assert there["source"].endswith("files verified")
    # a copy whose own git is not the checkout's (another HEAD): the stamp still names the files
    stale = tmp_path / "stale"
    shutil.copytree(checkout, stale)
    _git(stale, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "elsewhere")
    assert tree.tree(stale)["label"] == here["label"] != tree.git_tree(stale)["commit"][:12]
    (copy / "a.py").write_text("x = 3\n")  # edited after the stamp: the stamp no longer names it
    edited = tree.tree(copy)
    assert edited["label"] == "unknown tree" and "does not match the files" in edited["source"]
    (copy / tree.STAMP).unlink()
    assert tree.tree(copy)["source"].startswith("unknown: no git checkout and no")


def test_the_speculative_steps_identity_counts_each_output_up_to_its_first_difference():
    from pdserve.deploy.gpu_check.speculative import identical_tokens

    assert identical_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == (5, 5)
    # After a difference the rest is another text, even where it happens to agree again.
    assert identical_tokens([[1, 2, 3, 4], [4, 5]], [[1, 9, 3, 4], [4, 5]]) == (3, 6)
    assert identical_tokens([[7, 8]], [[6, 8]]) == (0, 2)
    with pytest.raises(ValueError):
        identical_tokens([[1]], [])


def test_the_speculative_step_measures_on_cpu_what_the_aim_reads():
    """The step's own measurement on this machine in float32 (eager: no graphs off CUDA), read
    by the bf16 identity aim: every token identical, so the aim is met."""
    from pdserve.deploy.gpu_check.speculative import measure

    data = measure("cpu", "float32", new_tokens=12)
    assert data["tokens"] == 12 * 6 and data["identical_tokens"] == data["tokens"]
    assert data["draft_tokens"] > 0 and data["row_steps"] == 0
    step = StepResult("speculative", "speculative", "passed", 1.0, data=data)
    rows = aims.judge([step], planned=[s.name for s in QUICK])
    assert aims.outcome(rows, "speculative_identity") == aims.MET
    assert report.details_speculative(step)[2].startswith("| float32 | 72/72 |")
