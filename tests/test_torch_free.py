"""The coordinator, its Python client and what they share with the nodes import no torch: a
coordinator host needs neither torch nor a GPU, and starts in a fraction of the time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

PROBE = """
import importlib, pkgutil, sys
from pdserve import cluster, coordinator
names = []
for package in (cluster, coordinator):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
assert len(names) > 10, names
import pdserve.serve  # the coordinator process: `pdserve serve` and `pdserve coordinator`
heavy = sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_the_coordinator_side_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"
