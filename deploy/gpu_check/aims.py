"""The performance aims a GPU check holds the measured figures to, in one table: each with its
text, the step whose record holds its figure, which cases and figure it reads, and the
threshold. A figure below its threshold is a miss, and a miss fails the run; an aim none of whose
cases was measured is "not measured", counted apart and never a pass.

Where an aim comes from: the decode and prefill steps' aims of docs/benchmarks.md, and issue 53's
list (decode at large batch, Hopper prefill attention, MoE at one to eight tokens, the bf16
speculative identity); the quantized GEMMs' aims follow from the bytes they read against cuBLAS
bf16 (a quarter for W4A16, a half for FP8) and from FP8 tensor cores for prefill.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.deploy.gpu_check.runner import StepResult

MET, MISSED, NOT_MEASURED = "met", "MISSED", "not measured"


@dataclass(frozen=True, slots=True)
class Case:
    """One measured case of an aim: where, the figure the threshold applies to, and how it reads."""

    case: str
    value: float
    measured: str


@dataclass(frozen=True, slots=True)
class Aim:
    key: str
    text: str  # what it asks, as the report and the docs say it
    step: str  # the step whose record (`data`) holds the figure
    threshold: float  # met when every case's figure is at least this
    cases: Callable[[dict[str, Any]], list[Case]]  # the step's data -> the cases the aim covers


@dataclass(frozen=True, slots=True)
class Verdict:
    """One row of the report: an aim against one case, or against nothing measured."""

    key: str
    aim: str
    case: str
    measured: str
    value: float | None
    threshold: float
    verdict: str  # met | MISSED | not measured (why)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- what each aim reads --------------------------------------------------------------------------


def _decode(min_batch: int) -> Callable[[dict[str, Any]], list[Case]]:
    """bench.model_step's whole decode steps from `min_batch` sequences: bytes read per second
    as a fraction of the measured copy."""

    def read(data: dict[str, Any]) -> list[Case]:
        out = []
        for r in data["decode"]:
            if r["batch"] >= min_batch:
                graph = "graph" if r.get("graph_ms") and r["graph_ms"] <= r["eager_ms"] else "eager"
                measured = (
                    f"{r['fraction_of_copy']:.0%} ({r['gbps']:.0f} of {data['copy_gbps']:.0f} GB/s)"
                )
                case = f"batch {r['batch']}, {r['context']} tokens ({graph})"
                out.append(Case(case, r["fraction_of_copy"], measured))
        return out

    return read


def _prefill_step(data: dict[str, Any]) -> list[Case]:
    """bench.model_step's whole prefill steps of 2048 tokens and more against the matmul."""
    return [
        Case(
            f"{r['prompts']} x {r['prompt_len']} tokens",
            r["fraction_of_matmul"],
            f"{r['fraction_of_matmul']:.0%} ({r['tflops']:.0f} of "
            f"{data['matmul_tflops']:.0f} TFLOP/s)",
        )
        for r in data["prefill"]
        if r["prompt_len"] >= 2048
    ]


def _prefill_attention(data: dict[str, Any]) -> list[Case]:
    """bench.kernels' causal prefill attention at 2k-8k tokens against the measured matmul,
    through the op table (the Hopper kernel's rows, on sm_90 and later, say so)."""
    return [
        Case(
            f"{r['prompts']} x {r['prompt_len']} tokens"
            + (" (Hopper kernel)" if r.get("kernel") == "hopper" else ""),
            r["fraction_of_matmul"],
            f"{r['fraction_of_matmul']:.0%} ({r['triton_tflops']:.0f} of "
            f"{data['matmul_tflops']:.0f} TFLOP/s)",
        )
        for r in data["prefill"]
        if 2048 <= r["prompt_len"] <= 8192
    ]


def _moe_small(data: dict[str, Any]) -> list[Case]:
    """bench.moe's Triton fused MoE at one to eight tokens: the touched experts' bytes per
    second as a fraction of the measured copy."""
    return [
        Case(
            f"{r['tokens']} token{'s' if r['tokens'] != 1 else ''}, {r['experts_touched']} experts",
            r["fraction_of_copy"]["triton"],
            f"{r['fraction_of_copy']['triton']:.0%} of {data['copy_gbps']:.0f} GB/s",
        )
        for r in data["rows"]
        if r["tokens"] <= 8
    ]


def _quant_gemm(kernel: str, rows: int) -> Callable[[dict[str, Any]], list[Case]]:
    """bench.quant_gemm's `kernel` at `rows` rows: its speed as a multiple of its bf16 baseline
    (cuBLAS bf16; for the FP8 MoE, the bf16 fused MoE), each weight shape a case."""

    def read(data: dict[str, Any]) -> list[Case]:
        return [
            Case(
                f"{'x'.join(map(str, r['weight']))}, {rows} row{'s' if rows != 1 else ''}",
                r["speedup"],
                f"{r['speedup']:.2f}x ({r['us']:.1f} vs {r['bf16_us']:.1f} µs)",
            )
            for r in data["rows"]
            if r["kernel"] == kernel and r["rows"] == rows
        ]

    return read


def _speculative_identity(data: dict[str, Any]) -> list[Case]:
    """The fraction of bf16 greedy tokens of speculative decoding equal to plain decoding's."""
    same, total = data["identical_tokens"], data["tokens"]
    return [Case(f"{total} greedy tokens", same / total, f"{same} of {total} identical")]


# The aims, in the report's order.
AIMS = (
    Aim("decode", "decode step, batch >= 64: >= 70% of copy", "model_step", 0.70, _decode(64)),
    Aim(
        "decode_large",
        "decode step at large batch (256): >= 75% of copy",
        "model_step",
        0.75,
        _decode(256),
    ),
    Aim(
        "prefill_step",
        "2048-token prefill step: >= 50% of bf16 matmul",
        "model_step",
        0.50,
        _prefill_step,
    ),
    Aim(
        "prefill_attention",
        "prefill attention, 2k-8k tokens: >= 60% of bf16 matmul",
        "kernels",
        0.60,
        _prefill_attention,
    ),
    Aim(
        "moe_small",
        "fused MoE, 1-8 tokens: >= 60% of copy for the active experts",
        "moe",
        0.60,
        _moe_small,
    ),
    Aim(
        "w4a16_decode",
        "W4A16 GEMM, 1 row: >= 1.5x cuBLAS bf16 (a quarter of the bytes)",
        "quant_gemm",
        1.5,
        _quant_gemm("w4a16", 1),
    ),
    Aim(
        "w8a16_decode",
        "FP8-weight GEMM (W8A16), 1 row: >= 1.3x cuBLAS bf16 (half the bytes)",
        "quant_gemm",
        1.3,
        _quant_gemm("w8a16_block", 1),
    ),
    Aim(
        "fp8_prefill",
        "FP8 block GEMM, 2048 rows: >= 1.3x cuBLAS bf16 (FP8 tensor cores)",
        "quant_gemm",
        1.3,
        _quant_gemm("fp8_block", 2048),
    ),
    Aim(
        "moe_fp8_decode",
        "FP8 fused MoE, 1 token: >= 1.3x the bf16 fused MoE (half the bytes)",
        "quant_gemm",
        1.3,
        _quant_gemm("moe_fp8", 1),
    ),
    Aim(
        "speculative_identity",
        "bf16 greedy speculative decoding: identical to plain decoding",
        "speculative",
        1.0,
        _speculative_identity,
    ),
)


# --- judging --------------------------------------------------------------------------------------


def _not_measured(aim: Aim, step: StepResult | None, planned: bool) -> str:
    if step is None:
        return "no step of this plan measures it" if not planned else f"{aim.step} did not run"
    why = f"{aim.step} {step.status}"
    return why + (f": {step.summary}" if step.summary else "")


def judge(
    results: Iterable[StepResult], aims: Iterable[Aim] = AIMS, planned: Iterable[str] = ()
) -> list[Verdict]:
    """Every aim against each case its step measured; one "not measured" row for an aim whose
    step did not run, recorded no data or measured none of its cases. `planned` names the steps
    of the run's plan (an aim whose step is not among them says so)."""
    steps = {r.name: r for r in results}
    planned = set(planned) | set(steps)
    rows = []
    for aim in aims:
        step = steps.get(aim.step)
        cases: list[Case] = []
        why = _not_measured(aim, step, aim.step in planned)
        if step is not None and step.data:
            try:
                cases = aim.cases(step.data)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
                why = f"{aim.step}'s record lacks its figure ({type(exc).__name__}: {exc})"
            else:
                why = f"{aim.step} measured no case it covers"
        for c in cases:
            verdict = MET if c.value >= aim.threshold else MISSED
            rows.append(
                Verdict(aim.key, aim.text, c.case, c.measured, c.value, aim.threshold, verdict)
            )
        if not cases:
            rows.append(
                Verdict(aim.key, aim.text, "-", "-", None, aim.threshold, f"{NOT_MEASURED} ({why})")
            )
    return rows


def outcome(rows: list[Verdict], key: str) -> str:
    """An aim's outcome over its cases: missed if any case missed, not measured if none was
    measured, else met."""
    mine = [r.verdict for r in rows if r.key == key]
    if MISSED in mine:
        return MISSED
    if all(v.startswith(NOT_MEASURED) for v in mine):
        return NOT_MEASURED
    return MET


def tally(rows: list[Verdict]) -> Counter[str]:
    """How many aims were met, missed and not measured."""
    return Counter(outcome(rows, key) for key in dict.fromkeys(r.key for r in rows))


def missed(rows: list[Verdict]) -> list[str]:
    """The keys of the aims missed, in the table's order."""
    return [k for k in dict.fromkeys(r.key for r in rows) if outcome(rows, k) == MISSED]


def count_line(rows: list[Verdict]) -> str:
    counts = tally(rows)
    return (
        f"Aims: {counts[MET]} met, {counts[MISSED]} missed, {counts[NOT_MEASURED]} not measured "
        f"(of {sum(counts.values())}; a miss fails the run, not measured is no pass)"
    )
