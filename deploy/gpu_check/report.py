"""The GPU check's report: a first screen that says what failed, where, and how the key figures
stand against the aims, then each step's details; beside it the raw JSON and one archive of
every log. Three files in --out, nothing else, so that they are easy to copy off the host."""

from __future__ import annotations

import json
import re
import tarfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pdserve.deploy.gpu_check import aims
from pdserve.deploy.gpu_check.plan import plan
from pdserve.deploy.gpu_check.runner import StepResult

FAILURES_ON_FIRST_SCREEN = 15
# Logs, records and configs go in the archive; no checkpoint, installed wheel or other bulk.
ARCHIVED_SUFFIXES = (".log", ".json", ".jsonl", ".toml", ".txt")
ARCHIVED_MAX_BYTES = 4 << 20
NOT_ARCHIVED = ("site", "model-cache")
REPORT, RESULTS, LOGS = "report.md", "results.json", "logs.tar.gz"


def verdicts(run: dict[str, Any], results: list[StepResult]) -> list[aims.Verdict]:
    """Every aim against what this run measured (the aims' table is `aims.AIMS`)."""
    planned = [s.name for s in plan(run.get("plan") == "long")]
    return aims.judge(results, planned=planned)


def failed(run: dict[str, Any], results: list[StepResult]) -> bool:
    """The run fails on a step that failed or ran out of time, and on a missed aim."""
    bad = any(r.status in ("failed", "timed out") for r in results)
    return bad or bool(aims.missed(verdicts(run, results)))


def headline(run: dict[str, Any], results: list[StepResult]) -> str:
    bad = [r for r in results if r.status in ("failed", "timed out")]
    missed = aims.missed(verdicts(run, results))
    ran_gpu = [r for r in results if r.name not in ("install", "env") and r.status != "skipped"]
    why = []
    if bad:
        why.append(f"{len(bad)} of {len(results)} steps: {', '.join(r.name for r in bad)}")
    if missed:
        why.append(
            f"{len(missed)} aim{'s' if len(missed) != 1 else ''} missed: {', '.join(missed)}"
        )
    if why:
        return f"FAILED ({'; '.join(why)})"
    if not ran_gpu:
        return "NOTHING RAN ON A GPU"
    return "PASSED"


def proof(results: list[StepResult]) -> str:
    """What the CUDA tests proved on this host: how many passed, how many failed or never
    reported, and how many it could not prove here, grouped by why (a skip is not a pass); then
    the paths other steps could not prove here (a serving transport without CuPy)."""
    line = _tests_proof(results)
    serving = next((r for r in results if r.name == "serving"), None)
    unproven = serving.data.get("not_proven", {}) if serving is not None else {}
    if unproven:
        whys = "; ".join(f"{path} ({why})" for path, why in sorted(unproven.items()))
        line += f". Serving not proven here: {whys}"
    return line


def _tests_proof(results: list[StepResult]) -> str:
    step = next((r for r in results if r.name == "tests"), None)
    if step is None or "tests" not in step.data:
        why = step.summary if step is not None else "the tests step was not in the plan"
        return f"CUDA tests: none proven here ({why or step.status})"
    tests = step.data["tests"].values()
    outcomes = Counter(t["outcome"] for t in tests)
    bad = outcomes["failed"] + outcomes["error"] + outcomes["not run"]
    line = f"CUDA tests: {outcomes['passed']} proven, {bad} failed or not run"
    unproven = Counter(t.get("reason", "") for t in tests if t["outcome"] == "skipped")
    if unproven:
        whys = "; ".join(f"{n}: {why}" for why, n in sorted(unproven.items(), key=lambda x: -x[1]))
        line += f", {sum(unproven.values())} not proven here ({whys})"
    return line


def more_gpus(results: list[StepResult]) -> str:
    """The command that proves what this host has too few GPUs for ("" when nothing wants more):
    the same check's tests step on a host with as many GPUs as the most demanding test needs."""
    step = next((r for r in results if r.name == "tests"), None)
    tests = step.data.get("tests", {}) if step is not None else {}
    needs = [
        int(m.group(1))
        for t in tests.values()
        if t["outcome"] == "skipped"
        for m in [re.search(r"(\d+) (?:CUDA )?device", t.get("reason", ""))]
        if m
    ]
    if not needs:
        return ""
    return (
        f"Not proven for want of GPUs ({len(needs)} tests: NCCL transfers, tensor parallelism): on "
        f"a host with {max(needs)} GPUs, `python -m pdserve.deploy.gpu_check --out OUT --only "
        f"install,env,tests` runs them."
    )


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: Iterable[Iterable[object]], align: str = "") -> list[str]:
    """A markdown table; `align` has one letter a column, r for right."""
    lines = ["| " + " | ".join(header) + " |"]
    seps = [("---:" if c == "r" else "---") for c in (align or "l" * len(header))]
    lines.append("| " + " | ".join(seps) + " |")
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def first_screen(run: dict[str, Any], results: list[StepResult]) -> list[str]:
    facts = next((r.data.get("facts", {}) for r in results if r.name == "env"), {})
    device = ", ".join(d["name"] for d in facts.get("devices", [])) or "no GPU"
    tree = run.get("tree", {}).get("label") or f"commit {facts.get('commit', '?')}"
    rows = verdicts(run, results)
    lines = [
        f"# pdserve GPU check: {headline(run, results)}",
        "",
        f"`{run['command']}` · {run['plan']} plan · {device} · tree {tree}"
        f" · {run['started']} · {run['seconds']:.0f} s of a {run['budget_s']:.0f} s budget",
        "",
        proof(results),
        aims.count_line(rows),
        "",
    ]
    wanting = more_gpus(results)
    if wanting:
        lines += [wanting, ""]
    lines += table(
        ["step", "result", "s", "summary"],
        (
            [
                r.name,
                r.status.upper() if r.status in ("failed", "timed out") else r.status,
                f"{r.seconds:.0f}",
                r.summary,
            ]
            for r in results
        ),
        "llrl",
    )
    lines += ["", "## Aims", ""]
    lines += table(["aim", "worst case", "measured", "verdict"], aim_lines(rows))
    failures = [(r.name, f) for r in results for f in r.failures]
    lines += ["", f"## Failures ({len(failures)})", ""]
    if not failures:
        lines.append("None.")
    for name, f in failures[:FAILURES_ON_FIRST_SCREEN]:
        lines.append(f"- **{name}** `{f['where']}`: {f['what']}")
    if len(failures) > FAILURES_ON_FIRST_SCREEN:
        lines.append(
            f"- … and {len(failures) - FAILURES_ON_FIRST_SCREEN} more: the steps below, `{RESULTS}`"
        )
    lines += [
        "",
        f"Logs: `{LOGS}` (`logs/<step>.log`; each step's folder with its record and, for "
        f"serving, every node's log). Raw figures: `{RESULTS}`.",
    ]
    return lines


def aim_lines(rows: list[aims.Verdict]) -> list[list[str]]:
    """One line per aim: its worst case, and its outcome over all its cases."""
    lines = []
    for key in dict.fromkeys(r.key for r in rows):
        mine = [r for r in rows if r.key == key]
        measured = [r for r in mine if r.value is not None]
        if not measured:
            lines.append([mine[0].aim, "-", "-", mine[0].verdict])
            continue
        worst = min(measured, key=lambda r: r.value)
        met = sum(r.verdict == aims.MET for r in measured)
        outcome = aims.outcome(rows, key)
        lines.append(
            [
                mine[0].aim,
                worst.case,
                worst.measured,
                f"{outcome} ({met} of {len(measured)} cases met)",
            ]
        )
    return lines


def details_aims(rows: list[aims.Verdict]) -> list[str]:
    """Every aim against every case it covers."""
    return table(
        ["aim", "case", "measured", "threshold", "verdict"],
        ([r.aim, r.case, r.measured, f"{r.threshold:g}", r.verdict] for r in rows),
        "lllrl",
    )


# --- details ------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _reason(test: dict[str, Any]) -> str:
    where = test.get("where")
    return test.get("reason", "") + (f" ({where})" if where else "")


def details_tests(r: StepResult) -> list[str]:
    sel = r.data.get("selection", {})
    lines = [
        f"Selected {sel.get('selected', '?')} of {sel.get('collected', '?')} tests (those that "
        f"skip with CUDA hidden, and tests/test_gpu_*.py) in {len(sel.get('files', []))} files."
    ]
    tests = r.data.get("tests", {})
    order = {"error": 0, "failed": 1, "not run": 2, "skipped": 3}
    others = sorted(
        ((k, v) for k, v in tests.items() if v["outcome"] != "passed"),
        key=lambda kv: (order.get(kv[1]["outcome"], 4), kv[0]),
    )
    if others:
        lines += [""] + table(
            ["test", "outcome", "s", "reason"],
            ([k, v["outcome"], f"{v['seconds']:.1f}", _reason(v)] for k, v in others),
            "llrl",
        )
    passed = sorted((k, v["seconds"]) for k, v in tests.items() if v["outcome"] == "passed")
    if passed:
        lines += ["", f"<details><summary>{len(passed)} passed</summary>", ""]
        lines += [f"- {k} ({s:.1f} s)" for k, s in passed] + ["", "</details>"]
    for k, v in others:
        if v.get("detail"):
            lines += ["", f"<details><summary>{k}</summary>", "", "```", v["detail"], "```"]
            lines += ["", "</details>"]
    return lines


def details_kernels(r: StepResult) -> list[str]:
    d = r.data
    lines = [
        f"Copy {d['copy_gbps']:.0f} GB/s, bf16 matmul {d['matmul_tflops']:.0f} TFLOP/s; "
        f"`{d.get('command', '')}`.",
        "",
    ]
    lines += table(
        ["batch", "context", "µs graph", "µs eager", "µs torch ref", "GB/s", "of copy"],
        (
            [
                x["batch"],
                x["context"],
                _num(x["triton_graph_us"]),
                _num(x["triton_eager_us"]),
                _num(x["reference_us"]),
                f"{x['triton_gbps']:.0f}",
                _pct(x["fraction_of_copy"]),
            ]
            for x in d["decode"]
        ),
        "rrrrrrr",
    )
    lines += [""] + table(
        ["prompts", "len", "kernel", "ms", "ms portable", "ms torch ref", "TFLOP/s", "of matmul"],
        (
            [
                x["prompts"],
                x["prompt_len"],
                x.get("kernel", "portable"),
                _num(x["triton_ms"], ".2f"),
                _num(x.get("portable_ms"), ".2f"),
                _num(x["reference_ms"], ".2f"),
                f"{x['triton_tflops']:.0f}",
                _pct(x["fraction_of_matmul"]),
            ]
            for x in d["prefill"]
        ),
        "rrlrrrrr",
    )
    if d.get("mixers"):  # window decode and Gated DeltaNet (bench/kernels_mixers.py)
        lines += [""] + table(
            ["mixer", "case", "ms", "ms torch ref", "of limit", "max abs error"],
            (
                [
                    x["mixer"],
                    x["case"],
                    _num(x["ms"], ".3f"),
                    _num(x["reference_ms"], ".3f"),
                    f"{_pct(x['fraction'])} of {'copy' if x['gb'] else 'matmul'}",
                    f"{x['max_abs_error']:.1e}",
                ]
                for x in d["mixers"]
            ),
            "llrrrr",
        )
    return lines


def details_quant_gemm(r: StepResult) -> list[str]:
    d = r.data
    lines = [
        f"{d['device']} (capability {'.'.join(map(str, d['capability']))}); "
        f"`{d.get('command', '')}`. Equal: the largest difference from the kernel's torch "
        "reference within its tolerance, as a fraction of the largest output.",
        "",
    ]
    lines += table(
        [
            "kernel",
            "weight",
            "rows",
            "µs",
            "µs cuBLAS bf16",
            "× bf16",
            "weight GB/s",
            "TFLOP/s",
            "equal",
        ],  # fmt: skip
        (
            [
                x["kernel"],
                "x".join(map(str, x["weight"])),
                x["rows"],
                _num(x["us"]),
                _num(x["bf16_us"]),
                f"{x['speedup']:.2f}",
                f"{x['weight_gbps']:.0f}",
                f"{x['tflops']:.1f}",
                f"{'yes' if x['equal'] else 'NO'} ({x['max_error']:.1e})",
            ]
            for x in d["rows"]
        ),
        "llrrrrrrl",
    )
    return lines


def details_model_step(r: StepResult) -> list[str]:
    d = r.data
    lines = [
        f"{d['device']}, {d['preset']} {d['dtype']}; copy {d['copy_gbps']:.0f} GB/s, "
        f"matmul {d['matmul_tflops']:.0f} TFLOP/s; `{d.get('command', '')}`.",
        "",
    ]
    lines += table(
        ["batch", "context", "ms graph", "ms eager", "GB read", "GB/s", "of copy"],
        (
            [
                x["batch"],
                x["context"],
                _num(x["graph_ms"], ".3f"),
                _num(x["eager_ms"], ".3f"),
                f"{x['bytes_gb']:.2f}",
                f"{x['gbps']:.0f}",
                _pct(x["fraction_of_copy"]),
            ]
            for x in d["decode"]
        ),
        "rrrrrrr",
    )
    lines += [""] + table(
        ["prompts", "len", "ms", "TFLOP", "TFLOP/s", "of matmul"],
        (
            [
                x["prompts"],
                x["prompt_len"],
                f"{x['ms']:.2f}",
                f"{x['tflop']:.2f}",
                f"{x['tflops']:.0f}",
                _pct(x["fraction_of_matmul"]),
            ]
            for x in d["prefill"]
        ),
        "rrrrrr",
    )
    return lines


def details_tiles(r: StepResult) -> list[str]:
    lines = table(
        ["case", "default ms", "best ms", "speedup", "best config", "default / best fraction"],
        (
            [
                case,
                f"{f['default_ms']:.3f}",
                f"{f['best_ms']:.3f}",
                f"{f['speedup']:.2f}x",
                " ".join(f"{k}={v}" for k, v in f["best"].items()),
                f"{_pct(f['default_fraction'])} / {_pct(f['best_fraction'])}",
            ]
            for case, f in r.figures.items()
        ),
        "lrrrll",
    )
    problems = [x for k in ("decode", "prefill") for x in r.data.get(k, []) if x.get("problem")]
    if problems:
        lines += ["", f"{len(problems)} configurations did not run or gave wrong results:"]
        lines += [
            f"- {x['case']} block_m={x['block_m']} block_n={x['block_n']} "
            f"warps={x['num_warps']} stages={x['num_stages']}: {x['problem']}"
            for x in problems[:20]
        ]
    parts = r.data.get("partitions", [])
    if parts:
        lines += [""] + table(
            ["case", "partition", "ms", "fraction", "problem"],
            (
                [
                    x["case"],
                    x["partition"],
                    _num(x["ms"], ".3f"),
                    _pct(x["fraction"]),
                    x.get("problem") or "",
                ]
                for x in parts
            ),
            "lrrrl",
        )
    return lines


def details_serving(r: StepResult) -> list[str]:
    model = r.data.get("model", {})
    lines = [
        f"Model: {model.get('parameters', 0) / 1e9:.2f} B parameters, bf16, engine "
        f"{model.get('engine')}; offline reference took {r.data.get('offline_s', 0):.0f} s."
    ]
    rows = []
    for t, x in r.data.get("transports", {}).items():
        load = x.get("load", {})
        ttft, tpot = load.get("ttft_ms", {}), load.get("tpot_ms", {})
        rows.append(
            [
                t,
                _num(x.get("start_s"), ".0f"),
                x.get("identical", "-"),
                f"{_num(ttft.get('p50'), '.0f')} / {_num(ttft.get('p99'), '.0f')}",
                f"{_num(tpot.get('p50'))} / {_num(tpot.get('p99'))}",
                _num(load.get("output_tokens_per_s"), ".0f"),
                _num(load.get("requests_per_s")),
                load.get("failed", "-"),
            ]
        )
    lines += [""] + table(
        [
            "transport",
            "start s",
            "streams identical",
            "TTFT ms p50 / p99",
            "TPOT ms p50 / p99",
            "output tok/s",
            "req/s",
            "failed",
        ],
        rows,
        "lrlrrrrr",
    )
    return lines


def details_parity(r: StepResult) -> list[str]:
    return table(
        [
            "family",
            "block",
            "triton = torch",
            "triton = transformers",
            "torch = transformers",
            "max logprob gap",
        ],
        (
            [
                x["family"],
                x["block_size"],
                x["triton_equals_torch"],
                x["triton_equals_transformers"],
                x["torch_equals_transformers"],
                f"{x['max_logprob_gap']:.2e}",
            ]
            for x in r.data.get("cases", [])
        ),
        "lrlllr",
    )


def details_speculative(r: StepResult) -> list[str]:
    cases = [r.data, r.data.get("float32")] if r.data else []
    return table(
        ["dtype", "identical tokens", "plain tok/s", "speculative tok/s", "accepted", "graph rows"],
        (
            [
                x["dtype"],
                f"{x['identical_tokens']}/{x['tokens']}",
                f"{x['plain_tok_s']:.0f}",
                f"{x['speculative_tok_s']:.0f}",
                f"{x['accepted_tokens']}/{x['draft_tokens']}",
                x["row_steps"],
            ]
            for x in cases
            if x and "identical_tokens" in x
        ),
        "lrrrrr",
    )


def details_env(r: StepResult) -> list[str]:
    facts = r.data.get("facts", {})
    lines = [f"- {k}: {_cell(v)}" for k, v in facts.items()]
    versions = r.data.get("versions", {})
    if versions:
        lines.append(
            "- packages: " + ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items())
        )
    return lines


DETAILS = {
    "env": details_env,
    "tests": details_tests,
    "kernels": details_kernels,
    "model_step": details_model_step,
    "quant_gemm": details_quant_gemm,
    "tiles": details_tiles,
    "serving": details_serving,
    "parity": details_parity,
    "speculative": details_speculative,
}


def _step(results: dict[str, Any], name: str) -> StepResult:
    """A step of a results.json, as the run recorded it."""
    step = next((s for s in results["steps"] if s["name"] == name), None)
    if step is None:
        raise ValueError(f"the run has no {name} step")
    return StepResult(**step)


def docs_table(results: dict[str, Any], step: str, part: str = "") -> str:
    """One step's table of a results.json for the docs (`python -m pdserve.bench.docs`): the
    kernels' or model steps' `decode` or `prefill` table, the serving step's transports."""
    details = {
        "kernels": details_kernels,
        "model_step": details_model_step,
        "serving": details_serving,
    }[step](_step(results, step))
    tables = "\n".join(details).split("\n\n")
    tables = [t for t in tables if t.startswith("|")]
    index = {"": 0, "decode": 0, "prefill": 1}[part]
    return tables[index]


def render(run: dict[str, Any], results: list[StepResult]) -> str:
    lines = first_screen(run, results)
    lines += ["", "---", "", "## Aims, every case", ""] + details_aims(verdicts(run, results))
    tree = run.get("tree")
    if tree:
        lines += ["", f"Tree: {tree['label']}; diff sha256 {tree.get('diff_sha256') or '-'} "
                  f"({tree['source']})."]  # fmt: skip
    lines += ["", "## Steps"]
    for r in results:
        lines += ["", f"### {r.name}: {r.status} — {r.title}", "", r.summary or ""]
        if r.status == "skipped":
            continue
        if r.name in DETAILS and r.data:
            try:
                lines += [""] + DETAILS[r.name](r)
            except (KeyError, TypeError, ValueError) as exc:  # a partial record: say so
                lines += ["", f"(details incomplete: {type(exc).__name__}: {exc})"]
        for note in r.notes:
            lines.append(f"- note: {note}")
        lines.append(f"\nLog: `{r.log}`.")
    return "\n".join(lines) + "\n"


def write(out: Path, run: dict[str, Any], results: list[StepResult], work: Path) -> list[Path]:
    """report.md, results.json and logs.tar.gz in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / REPORT
    report.write_text(render(run, results))
    raw = out / RESULTS
    raw.write_text(
        json.dumps(
            {
                "run": run,
                "aims": [v.as_dict() for v in verdicts(run, results)],
                "steps": [r.as_dict() for r in results],
            },
            indent=1,
            default=str,
        )
    )
    archive = out / LOGS
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            relative = path.relative_to(work)
            if (
                path.is_file()
                and relative.parts[0] not in NOT_ARCHIVED
                and path.suffix in ARCHIVED_SUFFIXES
                and path.stat().st_size <= ARCHIVED_MAX_BYTES
            ):
                tar.add(path, arcname=str(relative))
    return [report, raw, archive]
