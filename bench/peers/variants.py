"""pdserve's engine settings as systems of the peer benchmark: `LABEL=FLAGS` names a pdserve run
with some engine flags (`--cpu-threads`, `--cpu-bind`, `--[no-]compile`, `--cpu-linear`), so that settings can be
chosen by measurement beside the peer, in the same alternating rounds.

    --pdserve-variant 'one-bound=--cpu-threads 1 --cpu-bind 0'"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass

from pdserve.engine.config import CPU_LINEAR_BACKENDS

DEFAULT_LABEL = "pdserve"
LABEL = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True, slots=True)
class Variant:
    label: str
    flags: tuple[str, ...] = ()  # engine flags, as the pdserve runner takes them


DEFAULT = Variant(DEFAULT_LABEL)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine settings a pdserve round may set (absent: the engine's defaults)."""
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--cpu-bind", default=None)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--cpu-linear", choices=CPU_LINEAR_BACKENDS, default=None)
    p.add_argument("--cpu-adaptive-threads", action=argparse.BooleanOptionalAction, default=None)


def engine_options(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments of the flags that were given."""
    names = ("cpu_threads", "cpu_bind", "compile", "cpu_linear", "cpu_adaptive_threads")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def parse_variant(spec: str, taken: set[str] = frozenset()) -> Variant:
    """`LABEL=FLAGS` -> Variant; a ValueError says in one line what is wrong."""
    label, sep, flags = spec.partition("=")
    label = label.strip()
    if not sep or not LABEL.match(label):
        raise ValueError(f"pdserve variant {spec!r} is not LABEL=FLAGS (LABEL of [A-Za-z0-9._-])")
    if label in taken:
        raise ValueError(f"pdserve variant label {label!r} is used twice (or names the peer)")
    argv = shlex.split(flags)
    p = argparse.ArgumentParser(prog=label, add_help=False, exit_on_error=False)
    add_engine_flags(p)
    try:
        _, unknown = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"pdserve variant {label!r}: {e}") from None
    if unknown:
        raise ValueError(
            f"pdserve variant {label!r}: {' '.join(unknown)} is not an engine flag "
            "(--cpu-threads, --cpu-bind, --[no-]compile, --cpu-linear)"
        )
    return Variant(label, tuple(argv))


def parse_variants(specs: list[str], peer: str) -> list[Variant]:
    """The default run first, then each named variant, labels unique and apart from the peer."""
    variants = [DEFAULT]
    for spec in specs:
        variants.append(parse_variant(spec, {v.label for v in variants} | {peer}))
    return variants
