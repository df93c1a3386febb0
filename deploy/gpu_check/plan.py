"""The steps of a GPU check, in order, each with its time box: the quick plan (`make gpu-check`)
runs every CUDA path the host's GPUs allow and takes the headline figures; the long plan (`make gpu-check-long`)
runs the full benchmark sweeps for the docs. Each ends within its budget (`BUDGET_S`, 9 minutes
by default, `--budget-s`), so that one run of either fits a 10-minute command on a GPU host."""

from __future__ import annotations

from dataclasses import dataclass

# Seconds for all steps: the check ends within 10 minutes, with room for the interpreter's start
# and the report.
BUDGET_S = 540
# A step offered less than this is skipped rather than started to be cut off at once.
MIN_STEP_S = 10


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    title: str
    module: str  # run as `python -m <module> <args> --json ... --work ... --deadline ...`
    box_s: int  # its time box; time left unused by earlier steps is added to it
    needs: tuple[str, ...] = ()  # facts of the env step: "cuda", "cupy"
    args: tuple[str, ...] = ()


INSTALL = Step(
    "install", "wheels installed with pip --no-index", "pdserve.deploy.gpu_check.install", 30
)
ENV = Step("env", "the host, and every import and requirement", "pdserve.deploy.gpu_check.env", 25)
CUDA = ("cuda",)
BENCH = "pdserve.deploy.gpu_check.bench_steps"


def gpu_step(name: str, title: str, module: str, box_s: int, *args: str) -> Step:
    return Step(name, title, module, box_s, CUDA, args)


QUICK = (
    INSTALL,
    ENV,
    # Not a GPU step: without CUDA it lists every CUDA test as not proven here, and why.
    Step("tests", "every test that skips without CUDA", "pdserve.deploy.gpu_check.gpu_tests", 100),
    gpu_step(
        "kernels", "pdserve.bench.kernels --quick (Llama-3-8B attention)", BENCH, 50, "kernels"
    ),
    gpu_step("tiles", "Triton attention tile sweep", "pdserve.deploy.gpu_check.tiles", 45),
    gpu_step(
        "model_step", "pdserve.bench.model_step --quick (Llama-3-8B)", BENCH, 70, "model_step"
    ),
    gpu_step("moe", "pdserve.bench.moe --quick (a Qwen3-30B-A3B MoE layer)", BENCH, 25, "moe"),
    # Every quantized GEMM against cuBLAS bf16 and its reference; most of its box is compiling
    # the kernels (15 tile variants).
    gpu_step(
        "quant_gemm",
        "pdserve.bench.quant_gemm (W4A16, FP8 block, FP8 MoE)",
        BENCH,
        45,
        "quant_gemm",
    ),
    gpu_step(
        "serving", "pdserve serve on cuda_ipc and tcp", "pdserve.deploy.gpu_check.serving", 85
    ),
    gpu_step(
        "parity", "float32: Triton vs torch vs transformers", "pdserve.deploy.gpu_check.parity", 35
    ),
    # n-gram speculation against plain decoding: the bf16 identity aim, and its rate.
    gpu_step(
        "speculative",
        "n-gram speculative decoding vs plain, greedy bf16 and float32",
        "pdserve.deploy.gpu_check.speculative",
        30,
    ),
)

LONG = (
    INSTALL,
    ENV,
    gpu_step("kernels", "pdserve.bench.kernels, full sweep", BENCH, 120, "kernels"),
    gpu_step("model_step", "pdserve.bench.model_step, full sweep", BENCH, 150, "model_step"),
    gpu_step(
        "tiles", "Triton attention tile sweep, full grid", "pdserve.deploy.gpu_check.tiles", 150
    ),
    Step(
        "kv_transfer",
        "pdserve.bench.kv_transfer over cuda_ipc",
        BENCH,
        65,
        ("cuda", "cupy"),
        ("kv_transfer",),
    ),
)


def plan(long: bool = False) -> tuple[Step, ...]:
    return LONG if long else QUICK
