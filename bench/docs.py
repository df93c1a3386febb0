"""Render the docs' benchmark tables from the results files committed under bench/results/.

A table in the docs is written between two markers that name the function rendering it and the
results files it reads:

    <!-- bench.docs: bench.soak.memory_table bench/results/soak_tcp.json process=decode -->
    | process | ... |
    <!-- /bench.docs -->

The function is `pdserve.bench.soak.memory_table`; it is called with each file's parsed JSON,
in order, and the `key=value` options as keyword arguments (strings), and returns markdown. Under
what it returns goes one line per file naming the run: its command, commit, date, machine and
load, as the file records them (`tune.provenance.describe`), "not recorded" where it does not.

    python -m pdserve.bench.docs            # renders every block in place
    python -m pdserve.bench.docs --check    # exits 1 naming each block that differs from its
                                            # render, and each table outside any block

In a checked doc every table must be rendered, or be marked as no figure by the line
`<!-- bench.docs: not a figure -->` right above it (a table of settings, of commands), so a
number can be neither edited by hand nor outlive its data. The test suite runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.tune.provenance import NOT_RECORDED, describe

REPO_ROOT = Path(__file__).resolve().parents[1]
# The docs whose every table is checked.
CHECKED = ("docs/benchmarks.md", "docs/tuning.md", "docs/security.md")

OPEN = re.compile(r"^<!-- bench\.docs: (?P<spec>.+?) -->$")
CLOSE = "<!-- /bench.docs -->"
NOT_A_FIGURE = "<!-- bench.docs: not a figure -->"


class DocsError(ValueError):
    """A marker that cannot be rendered: unknown function, missing file, unclosed block."""


@dataclass(frozen=True)
class Block:
    """One rendered block: its function, files and options, and where it sits (0-based lines,
    `start` the opening marker, `end` the closing one)."""

    function: str
    files: tuple[str, ...]
    options: tuple[tuple[str, str], ...]
    start: int
    end: int
    section: str

    @property
    def key(self) -> tuple:
        return (self.section, self.files)


def parse_spec(spec: str, line: int) -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]:
    words = spec.split()
    if not words:
        raise DocsError(f"line {line + 1}: a bench.docs marker names no function")
    function, files, options = words[0], [], []
    for word in words[1:]:
        if "=" in word:
            key, value = word.split("=", 1)
            options.append((key, value))
        else:
            files.append(word)
    return function, tuple(files), tuple(options)


def find_blocks(lines: list[str]) -> list[Block]:
    blocks, section, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line
        m = OPEN.match(line)
        if m and line != NOT_A_FIGURE:
            function, files, options = parse_spec(m.group("spec"), i)
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == CLOSE), None)
            if end is None:
                raise DocsError(f"line {i + 1}: bench.docs block for {function} is never closed")
            nested = next((j for j in range(i + 1, end) if OPEN.match(lines[j])), None)
            if nested is not None:
                raise DocsError(f"line {i + 1}: bench.docs block opens again at line {nested + 1}")
            blocks.append(Block(function, files, options, i, end, section))
            i = end
        i += 1
    return blocks


def load_results(path: str, root: Path) -> Any:
    full = root / path
    if not full.is_file():
        raise DocsError(f"results file {path} does not exist")
    return json.loads(full.read_text())


def resolve(function: str):
    module_name, _, attr = function.rpartition(".")
    if not module_name:
        raise DocsError(f"{function}: give the function as module.function under pdserve")
    try:
        module = importlib.import_module(f"pdserve.{module_name}")
    except ImportError as e:
        raise DocsError(f"{function}: cannot import pdserve.{module_name}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise DocsError(f"{function}: pdserve.{module_name} has no function {attr}")
    return fn


def source_line(path: str, results: Any) -> str:
    """The run a file holds, in one line; a file that records no command is refused: nobody could
    measure its figures again."""
    info = describe(results if isinstance(results, dict) else {})
    if info["command"] == NOT_RECORDED:
        raise DocsError(f"{path} records no command: its figures cannot be measured again")
    return (
        f"<sub>`{path}`: `{info['command']}` · commit {info['commit']} · {info['date']} · "
        f"{info['machine']} · {info['load']}</sub>"
    )


def render_block(block: Block, root: Path, following: Block | None) -> list[str]:
    """The block's lines: its table, and under it the run's line, unless the next block is of
    the same files in the same section (then the line comes once, under the last of them)."""
    fn = resolve(block.function)
    results = [load_results(f, root) for f in block.files]
    try:
        body = fn(*results, **dict(block.options)).strip("\n")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise DocsError(f"{block.function} cannot render {', '.join(block.files)}: {e!r}") from e
    out = body.split("\n")
    if following is None or following.key != block.key:
        out.append("")
        out += [source_line(f, r) for f, r in zip(block.files, results)]
    return out


def render(text: str, root: Path = REPO_ROOT) -> str:
    """The doc with every block rendered again."""
    lines = text.split("\n")
    blocks = find_blocks(lines)
    out, at = [], 0
    for block, following in zip(blocks, [*blocks[1:], None]):
        out += lines[at : block.start + 1]
        out += render_block(block, root, following)
        at = block.end
    out += lines[at:]
    return "\n".join(out)


def unrendered_tables(text: str) -> list[int]:
    """1-based lines where a table starts outside every block and is not marked as no figure."""
    lines = text.split("\n")
    inside = set()
    for block in find_blocks(lines):
        inside.update(range(block.start, block.end + 1))
    starts = []
    for i, line in enumerate(lines):
        if not line.startswith("|") or i in inside:
            continue
        if i > 0 and lines[i - 1].startswith("|"):
            continue  # not a table's first line
        if i > 0 and lines[i - 1] == NOT_A_FIGURE:
            continue
        starts.append(i + 1)
    return starts


def check(paths: list[str], root: Path = REPO_ROOT) -> list[str]:
    """What is wrong with the docs: a block that differs from its render, a table outside any
    block, a block that cannot be rendered. Empty when they are as their data says."""
    problems = []
    for path in paths:
        text = (root / path).read_text()
        try:
            rendered = render(text, root)
        except DocsError as e:
            problems.append(f"{path}: {e}")
            continue
        if rendered != text:
            diff = difflib.unified_diff(
                text.split("\n"), rendered.split("\n"), path, f"{path} rendered", lineterm="", n=0
            )
            shown = list(diff)[:40]
            problems.append(f"{path}: differs from its results files:\n" + "\n".join(shown))
        for line in unrendered_tables(text):
            problems.append(f"{path}:{line}: a table not rendered from a results file")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.docs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference")
    p.add_argument("docs", nargs="*", default=list(CHECKED), help="docs under the repository")
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.docs)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"bench.docs: {len(problems)} problem(s)", file=sys.stderr)
            return 1
        print(f"bench.docs: {', '.join(args.docs)} as their results files say")
        return 0
    for path in args.docs:
        full = REPO_ROOT / path
        text = full.read_text()
        try:
            rendered = render(text)
        except DocsError as e:
            print(f"bench.docs: {path}: {e}", file=sys.stderr)
            return 1
        if rendered != text:
            full.write_text(rendered)
            print(f"rendered {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
