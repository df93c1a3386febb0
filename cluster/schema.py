"""One declaration per setting: a dataclass field made with `setting(...)` holds its default, its
meaning and its limits, and everything else follows from the fields here: validation, command-line
flags (and the flags that recreate an object in a child process), checked TOML tables, the rows of
the documentation. It knows no particular setting and imports no torch."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import numbers
import os
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger("pdserve.settings")

T = TypeVar("T")
REQUIRED: Any = dataclasses.MISSING  # the default of a setting that must be given
KINDS = (bool, int, float, str)
KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
MANY_WORDS = {int: "integers", float: "numbers", str: "strings"}  # tuple[kind, ...]


@dataclass(frozen=True, slots=True)
class Setting:
    help: str  # what it means, in a line: the flag's help and the docs' row
    live: bool = False  # may change while running (the coordinator re-reads it on SIGHUP)
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None  # value >= minimum
    maximum: float | None = None  # value <= maximum
    above: float | None = None  # value > above
    below: float | None = None  # value < below
    old_names: tuple[str, ...] = ()  # accepted in files with a warning


def setting(
    default: Any = REQUIRED,
    help: str = "",
    *,
    live: bool = False,
    choices: Collection[Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    old_names: Collection[str] = (),
) -> Any:
    """A dataclass field declaring one setting; the class calls `validate(self)` in its
    `__post_init__`."""
    spec = Setting(
        help,
        live,
        None if choices is None else tuple(choices),
        minimum,
        maximum,
        above,
        below,
        tuple(old_names),
    )
    return dataclasses.field(default=default, metadata={"setting": spec})


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting of a class, as its field declares it."""

    name: str
    kind: type  # bool, int, float or str: of the setting, or of each of its items
    optional: bool  # None is a value: unset
    default: Any  # REQUIRED when it must be given
    spec: Setting
    many: bool = False  # a list of values (tuple[kind, ...]), its limits holding for each item

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


def _kind(cls: type, name: str, hint: object) -> tuple[type, bool, bool]:
    """(kind, optional, many) of a field's type hint."""
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            hint, optional = rest[0], True
    args = typing.get_args(hint)
    many = typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis
    if many:
        hint = args[0]
    if hint in KINDS and not (many and hint is bool):  # a list of booleans would have no flag
        return hint, optional, many
    raise TypeError(
        f"{cls.__name__}.{name}: a setting is bool, int, float or str, or a tuple[int | float | "
        "str, ...] (or | None)"
    )


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """The settings of a dataclass, in declaration order (fields not made by `setting` are not
    settings)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("setting")
        if spec is not None:
            kind, optional, many = _kind(cls, f.name, hints[f.name])
            out.append(Declared(f.name, kind, optional, f.default, spec, many))
    return tuple(out)


def names(cls: type) -> tuple[str, ...]:
    return tuple(d.name for d in declared(cls))


def defaults(cls: type) -> dict[str, Any]:
    return {d.name: d.default for d in declared(cls) if not d.required}


def pick(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `values` that are settings of cls."""
    own = set(names(cls))
    return {k: v for k, v in values.items() if k in own}


# --- validation ---------------------------------------------------------------------------------


def _typed(d: Declared, value: Any, label: str) -> Any:
    if value is None and d.optional:
        return None
    if d.many:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{label} must be a list of {MANY_WORDS[d.kind]}, got {_shown(value)}")
        one = dataclasses.replace(d, optional=False, many=False)
        return tuple(_typed(one, item, f"{label}: every item") for item in value)
    if d.kind is bool and isinstance(value, bool):
        return value
    if d.kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if d.kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if d.kind is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)  # a path for a text setting is taken as its text
    raise ValueError(f"{label} must be {KIND_WORDS[d.kind]}, got {_shown(value)}")


def check(d: Declared, value: Any, label: str | None = None) -> Any:
    """`value` as the setting holds it (an int for a float setting becomes a float), or a
    ValueError that names the setting (as `label`)."""
    label = label or d.name
    value = _typed(d, value, label)
    if value is None:
        return None
    if d.many:
        one = dataclasses.replace(d, optional=False, many=False)
        return tuple(check(one, item, f"{label}: every item") for item in value)
    s = d.spec
    if s.choices is not None and value not in s.choices:
        one_of = ", ".join(map(str, s.choices))
        raise ValueError(f"{label} must be one of {one_of}, got {_shown(value)}")
    for bound, ok, words in (
        (s.minimum, lambda b: value >= b, ">="),
        (s.maximum, lambda b: value <= b, "<="),
        (s.above, lambda b: value > b, ">"),
        (s.below, lambda b: value < b, "<"),
    ):
        if bound is not None and not ok(bound):
            raise ValueError(f"{label} must be {words} {bound}, got {_shown(value)}")
    return value


def validate(obj: object) -> None:
    """Check every setting of a dataclass instance (from its `__post_init__`), normalising
    values in place; a ValueError names the first bad one."""
    for d in declared(type(obj)):
        value = getattr(obj, d.name)
        held = check(d, value)
        if held is not value:
            object.__setattr__(obj, d.name, held)  # frozen dataclasses too


# --- command-line flags -------------------------------------------------------------------------


def _help(d: Declared) -> str:
    if d.required:
        text = f"{d.spec.help} (required)"
    elif d.default is None:
        text = d.spec.help  # which says what unset means
    else:
        default = d.default if isinstance(d.default, str) else _shown(d.default)
        text = f"{d.spec.help} (default: {default})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    suppress_defaults: bool = False,
) -> None:
    """One flag per setting of cls: `max_num_seqs` is `--max-num-seqs`, a boolean is a pair
    (`--enable-prefix-caching` / `--no-enable-prefix-caching`). With `suppress_defaults`, a flag
    not given leaves no attribute, so the flags given can override another source."""
    for d in declared(cls):
        if d.name in exclude or (only is not None and d.name not in only):
            continue
        kwargs: dict[str, Any] = {"dest": d.name, "help": _help(d)}
        if suppress_defaults:
            kwargs["default"] = argparse.SUPPRESS
        elif d.required:
            kwargs["required"] = True
        else:
            kwargs["default"] = d.default
        if d.kind is bool:
            parser.add_argument(d.flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            many = {"nargs": "*"} if d.many else {}
            parser.add_argument(d.flag, type=d.kind, choices=d.spec.choices, **many, **kwargs)


def values_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The settings of cls that `args` holds."""
    return {d.name: getattr(args, d.name) for d in declared(cls) if hasattr(args, d.name)}


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    return cls(**{**values_from_args(cls, args), **given})


def to_flags(obj: object) -> list[str]:
    """The flags that recreate obj where `add_flags(parser, type(obj))` parses them: every
    required setting and every one that differs from its default."""
    out: list[str] = []
    for d in declared(type(obj)):
        value = getattr(obj, d.name)
        if not d.required and value == d.default:
            continue
        if d.many and value is not None:
            out += [d.flag, *map(str, value)]
        elif d.kind is bool:
            out.append(d.flag if value else "--no-" + d.flag[2:])
        elif value is None:
            raise ValueError(f"{d.name}: None is no flag value (its default is {d.default!r})")
        elif str(value).startswith("-"):
            out.append(f"{d.flag}={value}")  # joined, or argparse would read the value as a flag
        else:
            out += [d.flag, str(value)]
    return out


# --- TOML tables --------------------------------------------------------------------------------


def read_table(
    table: Mapping[str, Any],
    *classes: type,
    where: str = "",
    refuse: Mapping[str, str] | None = None,
    tables: Collection[str] = (),
    list_known: bool = False,
) -> list[dict[str, Any]]:
    """Split a TOML table into the settings of each class, every value checked: an unknown key, a
    key in `refuse` (with its reason), a wrong type or a value out of range is a ValueError naming
    the key after `where`. An old name is read as its setting, with a warning. Keys in `tables`
    hold tables the caller reads itself: they are skipped here. With `list_known`, an unknown key
    unlike any known one is told every key the table takes."""
    refuse = refuse or {}
    owner: dict[str, tuple[int, Declared]] = {}
    old: dict[str, str] = {}
    for index, cls in enumerate(classes):
        for d in declared(cls):
            if d.name in owner:
                raise TypeError(f"setting {d.name!r} is declared twice")
            owner[d.name] = (index, d)
            old.update(dict.fromkeys(d.spec.old_names, d.name))
    out: list[dict[str, Any]] = [{} for _ in classes]
    for key, value in table.items():
        if key in tables:
            continue
        name = old.get(key, key)
        if name != key:
            if name in table:
                raise ValueError(f"{where}keys '{key}' and '{name}' are one setting: give '{name}'")
            logger.warning("%skey '%s' is an old name of '%s'; read as such", where, key, name)
        if name in refuse:
            raise ValueError(f"{where}key '{key}' is not set here: {refuse[name]}")
        if name not in owner:
            known = [n for n in owner if n not in refuse] + list(tables)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            if list_known and not close:
                hint = f" (known keys: {', '.join(known)})"
            raise ValueError(f"{where}unknown key '{key}'{hint}")
        index, d = owner[name]
        out[index][name] = check(d, value, f"{where}key '{key}'")
    return out


def check_required(cls: type, values: Mapping[str, Any], where: str = "") -> None:
    """A ValueError naming the first required setting of cls that `values` (as `read_table` gives
    them) lacks, and what it means."""
    for d in declared(cls):
        if d.required and d.name not in values:
            raise ValueError(f"{where}key '{d.name}' is required: {d.spec.help}")


# --- documentation ------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A value as it is written in a TOML file."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return str(value)


def doc_rows(cls: type, only: Collection[str] | None = None) -> list[tuple[str, str, str, str]]:
    """(key, default, live or restart, meaning) for each setting of cls, in declaration order."""
    return [
        (
            d.name,
            "required" if d.required else _shown(d.default),
            "live" if d.spec.live else "restart",
            d.spec.help,
        )
        for d in declared(cls)
        if only is None or d.name in only
    ]


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines) + "\n"
