"""The flags of `vllm serve` that `pdserve serve` accepts so a vLLM command line starts it: one table
says, for each, what pdserve does with it and why; the CLI adds them as one group and applies them."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.cluster.schema import add_flags
from pdserve.coordinator.config import CoordinatorConfig

# What pdserve does with a flag.
APPLIED = "applied"  # it has the meaning vLLM gives it
IGNORED = "ignored"  # accepted with a one-line warning saying why
ONE_ONLY = "one only"  # 1 accepted silently; above 1 refused, saying what to use instead
CHECKED = "checked"  # accepted where it changes nothing, refused where it would

GROUP_TITLE = "vLLM compatibility (flags of `vllm serve`, so its command line starts pdserve)"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
NO_HUB = "pdserve uses no model hub: MODEL is a local directory"


@dataclass(frozen=True, slots=True)
class VllmFlag:
    names: tuple[str, ...]  # the first is the long form
    dest: str
    treatment: str
    why: str  # what pdserve does with it: its help line and, when warned, its warning
    argument: dict[str, Any] = field(default_factory=dict)  # argparse's keywords
    unset: str = "unset: none"  # what its help says of it when not given

    @property
    def help(self) -> str:
        return f"{self.why} ({self.unset})"

    @property
    def flag(self) -> str:
        return self.names[0]


FLAGS = (
    VllmFlag(
        ("--trust-remote-code",),
        "trust_remote_code",
        IGNORED,
        "pdserve runs only the model families it implements; no remote code is ever run",
        {"action": "store_true"},
        "default: off",
    ),
    VllmFlag(
        ("--disable-log-requests",),
        "disable_log_requests",
        APPLIED,
        "no access line per request (the pdserve.access log)",
        {"action": "store_true"},
        "default: off",
    ),
    VllmFlag(
        ("--disable-log-stats",),
        "disable_log_stats",
        APPLIED,
        "no periodic stats line (the pdserve.stats log)",
        {"action": "store_true"},
        "default: off",
    ),
    VllmFlag(
        ("--uvicorn-log-level",),
        "uvicorn_log_level",
        APPLIED,
        "log level of the HTTP server, uvicorn",
        {"choices": UVICORN_LOG_LEVELS, "type": str.lower, "metavar": "LEVEL"},
        "unset: --log-level",
    ),
    VllmFlag(
        ("--tokenizer",),
        "tokenizer",
        CHECKED,
        "pdserve reads the tokenizer from the model directory: the model's own is accepted, "
        "another refused",
        {"metavar": "DIR"},
        "unset: the model's",
    ),
    VllmFlag(
        ("--generation-config",),
        "generation_config",
        CHECKED,
        "auto or vllm: pdserve takes only the end-of-sequence tokens from the model's "
        "generation_config.json, never its sampling defaults; a folder is ignored",
        {"metavar": "auto|vllm|DIR"},
        "unset: auto",
    ),
    VllmFlag(("--revision",), "revision", IGNORED, NO_HUB, {"metavar": "REV"}),
    VllmFlag(("--download-dir",), "download_dir", IGNORED, NO_HUB, {"metavar": "DIR"}),
    VllmFlag(
        ("--kv-transfer-config",),
        "kv_transfer_config",
        IGNORED,
        "pdserve is disaggregated by design: its KV moves by --transport between the nodes "
        "of --prefill-nodes and --decode-nodes",
        {"metavar": "JSON"},
    ),
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        "pipeline_parallel_size",
        ONE_ONLY,
        "pdserve has no pipeline parallelism: split a model over devices with "
        "--tensor-parallel-size",
        {"type": int, "metavar": "N", "default": 1},
        "default: 1",
    ),
    VllmFlag(
        ("--data-parallel-size", "-dp"),
        "data_parallel_size",
        ONE_ONLY,
        "pdserve's replicas are its nodes: give --prefill-nodes / --decode-nodes, or a "
        "cluster file (pdserve launch)",
        {"type": int, "metavar": "N", "default": 1},
        "default: 1",
    ),
)
# Coordinator settings that are vLLM flags of the same name and meaning.
COORDINATOR_SETTINGS = ("max_logprobs",)
# The logs a --disable-log-* flag quiets (the coordinator writes both, in serve's process).
QUIETED_LOGS = {"disable_log_requests": "pdserve.access", "disable_log_stats": "pdserve.stats"}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The group of vLLM's flags in `pdserve serve --help`."""
    group = parser.add_argument_group(GROUP_TITLE)
    for f in FLAGS:
        argument = {"default": None, **f.argument}
        group.add_argument(*f.names, dest=f.dest, help=f.help, **argument)
    group.add_argument(
        "-tp",
        dest="tensor_parallel_size",
        type=int,
        metavar="N",
        default=argparse.SUPPRESS,
        help="short for --tensor-parallel-size (default: 1)",
    )
    add_flags(group, CoordinatorConfig, only=COORDINATOR_SETTINGS, suppress_defaults=True)


def _same_directory(a: str, b: str | None) -> bool:
    if b is None:
        return False
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def apply_vllm_flags(args: argparse.Namespace, model: str | None) -> list[str]:
    """Apply the vLLM flags given (quiet a log) and return the lines to print once at start;
    a ValueError, one line, for a flag pdserve must refuse. `model` is the model as given."""
    lines: list[str] = []
    for f in FLAGS:
        value = getattr(args, f.dest, None)
        if value is None or value is False:
            continue
        if f.treatment == IGNORED:
            lines.append(f"pdserve: warning: {f.flag} ignored: {f.why}")
        elif f.treatment == ONE_ONLY and value != 1:
            raise ValueError(f"{f.flag} {value}: {f.why}")
    for dest, log in QUIETED_LOGS.items():
        if getattr(args, dest, False):
            logging.getLogger(log).setLevel(logging.WARNING)
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None and not _same_directory(tokenizer, model):
        raise ValueError(
            f"--tokenizer {tokenizer}: pdserve reads the tokenizer from the model directory "
            f"({model or 'the embedded model'}); copy that tokenizer's files there, or drop the flag"
        )
    generation_config = getattr(args, "generation_config", None)
    if generation_config in ("auto", "vllm"):
        lines.append(
            f"pdserve: note: --generation-config {generation_config}: pdserve takes only the "
            "end-of-sequence tokens from the model's generation_config.json, never its sampling "
            "defaults"
        )
    elif generation_config is not None:
        lines.append(
            f"pdserve: warning: --generation-config {generation_config} ignored: pdserve reads "
            "generation_config.json from the model directory only (its end-of-sequence tokens)"
        )
    return lines
