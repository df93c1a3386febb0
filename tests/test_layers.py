"""Dependencies run one way: each part of pdserve imports only the parts below it, `kv_transfer`
reaches into the engine only for the KV layout and pool, nothing in the product imports `bench`,
and no module imports another that imports it back, at any depth. Every import counts: at module
level, inside functions, and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(__file__).resolve().parent.parent

# Higher imports lower; equal levels do not import each other. pdserve (the command) is the top
# of the product; bench may use all of it, and the GPU host's check (deploy.gpu_check) bench too;
# the package root `pdserve` (its version, cache folder, parts) is below them all.
LEVEL = {
    "deploy": 7,
    "bench": 6,
    "pdserve": 5,
    "tune": 4,
    "coordinator": 3,
    "prefill_node": 3,
    "decode_node": 3,
    "kv_transfer": 2,
    "engine": 1,
    "cluster": 0,
    "kernels": 0,
}
KV_TRANSFER_MAY_USE = {"pdserve.engine.kv.cache"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "pdserve" else ("pdserve", *parts))


def modules() -> dict[str, Path]:
    found = {}
    for part in ("pdserve", *pdserve.PARTS):
        for path in (ROOT / part).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The modules of pdserve that a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            # `from package import module` is an import of the module; of names, the package's.
            found |= submodules if len(submodules) == len(node.names) else {node.module}
            found |= submodules
    return {name for name in found if name in known}


def part(module: str) -> str:
    """pdserve.engine.llm -> engine; pdserve.cli -> pdserve; pdserve -> root."""
    pieces = module.split(".")
    if len(pieces) == 1:
        return "root"
    return pieces[1] if pieces[1] in pdserve.PARTS else "pdserve"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, set(known)) - {name} for name, path in known.items()}


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            a, b = part(module), part(target)
            if a == b or b == "root":
                continue
            if LEVEL[a] <= LEVEL[b]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_kv_transfer_uses_only_the_engines_kv_layout_and_pool():
    reached = {
        target
        for module, targets in graph().items()
        if part(module) == "kv_transfer"
        for target in targets
        if part(target) == "engine"
    }
    assert reached <= KV_TRANSFER_MAY_USE


def test_no_module_imports_one_that_imports_it_back():
    edges = graph()
    cycles = []
    for start in edges:  # every module that can reach itself: a circle through it
        seen, todo = set(), list(edges[start])
        while todo:
            module = todo.pop()
            if module == start:
                cycles.append(start)
                break
            if module not in seen:
                seen.add(module)
                todo += edges.get(module, ())
    assert cycles == []


def test_the_check_sees_a_wrong_edge(tmp_path):
    # The checks read files: one that imports upwards is found.
    wrong = tmp_path / "engine_probe.py"
    wrong.write_text("from pdserve.coordinator import core\n")
    found = imports(wrong, {"pdserve.coordinator", "pdserve.coordinator.core"})
    assert found == {"pdserve.coordinator.core"}
    assert LEVEL[part("pdserve.engine.x")] <= LEVEL[part("pdserve.coordinator.core")]
