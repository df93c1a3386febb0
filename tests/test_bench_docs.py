"""bench.docs: the docs' tables are their results files' render, and nothing else."""

import json

import pytest

from pdserve.bench import docs
from pdserve.tune import provenance

PLAN = {
    "command": "python -m pdserve.bench.plan_codec --json-out x.json",
    "commit": "abc1234",
    "date": "2026-11-26 01:55 UTC",
    "machine": {"cpu": "AMD EPYC", "cores": 2, "cpu_flags": ["avx2", "avx512f"]},
    "load": {
        "before": "01:55 up 2:28, load average: 1.42, 1.30, 1.50",
        "after": "load average: 1.5",
    },
    "plans": {"decode, 64 sequences": {"bytes": 68588, "pickle_us": 11.9, "msgspec_us": 6.0}},
}
MARKER = "<!-- bench.docs: bench.plan_codec.docs_table bench/results/plan.json -->"


def write(root, doc: str, results: dict = PLAN) -> str:
    (root / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (root / "bench" / "results" / "plan.json").write_text(json.dumps(results))
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "b.md").write_text(doc)
    return "docs/b.md"


def rendered_doc(root) -> str:
    path = write(root, f"# A\n\nText.\n\n{MARKER}\n{docs.CLOSE}\n\nMore.\n")
    text = docs.render((root / path).read_text(), root)
    (root / path).write_text(text)
    return path


def test_every_checked_doc_is_its_results_files_render():
    assert docs.check(list(docs.CHECKED)) == []


def test_a_block_renders_its_table_and_names_the_run(tmp_path):
    path = rendered_doc(tmp_path)
    text = (tmp_path / path).read_text()
    assert "| decode, 64 sequences | 68,588 | 11.9 | 6.0 |" in text
    source = next(line for line in text.split("\n") if line.startswith("<sub>"))
    for part in ("bench/results/plan.json", PLAN["command"], "abc1234", "2026-11-26 01:55 UTC"):
        assert part in source
    assert "avx512f" in source and "load average 1.42 before, 1.5 after" in source
    assert docs.check([path], tmp_path) == []


def test_a_figure_edited_by_hand_fails_the_check(tmp_path):
    path = rendered_doc(tmp_path)
    doc = tmp_path / path
    doc.write_text(doc.read_text().replace("| 11.9 |", "| 9.9 |"))
    (problem,) = docs.check([path], tmp_path)
    assert "differs from its results files" in problem and "9.9" in problem


def test_a_changed_results_file_fails_the_check_until_rendered_again(tmp_path):
    path = rendered_doc(tmp_path)
    changed = json.loads(json.dumps(PLAN))
    changed["plans"]["decode, 64 sequences"]["pickle_us"] = 13.0
    (tmp_path / "bench/results/plan.json").write_text(json.dumps(changed))
    assert docs.check([path], tmp_path)
    doc = tmp_path / path
    doc.write_text(docs.render(doc.read_text(), tmp_path))
    assert docs.check([path], tmp_path) == []


def test_a_table_outside_a_block_fails_unless_marked_as_no_figure(tmp_path):
    table = "| a | b |\n| --- | --- |\n| 1 | 2 |\n"
    path = write(tmp_path, f"# A\n\n{table}")
    (problem,) = docs.check([path], tmp_path)
    assert f"{path}:3: a table not rendered" in problem
    write(tmp_path, f"# A\n\n{docs.NOT_A_FIGURE}\n{table}")
    assert docs.check([path], tmp_path) == []


def test_a_results_file_without_its_command_is_refused(tmp_path):
    path = write(
        tmp_path, f"{MARKER}\n{docs.CLOSE}\n", {k: v for k, v in PLAN.items() if k != "command"}
    )
    (problem,) = docs.check([path], tmp_path)
    assert "records no command" in problem


@pytest.mark.parametrize(
    "doc, message",
    [
        (f"{MARKER}\n", "never closed"),
        (
            "<!-- bench.docs: bench.plan_codec.no_such bench/results/plan.json -->\n"
            f"{docs.CLOSE}\n",
            "has no function no_such",
        ),
        (
            "<!-- bench.docs: bench.plan_codec.docs_table bench/results/none.json -->\n"
            f"{docs.CLOSE}\n",
            "does not exist",
        ),
    ],
)
def test_a_marker_that_cannot_render_is_a_problem_not_a_crash(tmp_path, doc, message):
    path = write(tmp_path, doc)
    (problem,) = docs.check([path], tmp_path)
    assert message in problem


def test_the_run_is_named_once_under_consecutive_tables_of_one_file(tmp_path):
    path = write(
        tmp_path,
        f"# A\n\n{MARKER}\n{docs.CLOSE}\n\n{MARKER}\n{docs.CLOSE}\n# B\n\n{MARKER}\n{docs.CLOSE}\n",
    )
    text = docs.render((tmp_path / path).read_text(), tmp_path)
    assert text.count("<sub>") == 2


def test_describe_reads_the_older_layouts_and_says_what_is_missing():
    old = {
        "command": "c",
        "machine": {"cpu": "X", "nproc": 2, "uptime_before": "load average: 2.65, 1"},
    }
    info = provenance.describe(old)
    assert info["commit"] == info["date"] == provenance.NOT_RECORDED
    assert info["machine"] == "X, 2 cores" and info["load"] == "load average 2.65 before"
    assert provenance.describe({})["load"] == f"load {provenance.NOT_RECORDED}"


def test_a_record_names_this_checkout_and_machine():
    record = provenance.finish(provenance.start(["bench/plan_codec.py", "--calls", "5"]))
    assert record["command"] == "python -m pdserve.bench.plan_codec --calls 5"
    assert record["machine"]["cores"] and "load average" in record["load"]["after"]
    assert record["date"].endswith("UTC")
