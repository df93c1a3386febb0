"""pdserve: its command line (`pdserve serve`, `launch`, `generate`, the node processes), its
release (the version every process of a cluster must share) and, as subpackages, every part of it:
`pdserve.engine`, `pdserve.kernels`, `pdserve.coordinator`, ... (the repository keeps each part in
a folder of its own at its top level: an installed wheel maps them under `pdserve/`, and a
checkout finds them beside this folder, below)."""

import os
from pathlib import Path

__version__ = "0.1.0"

# The parts of pdserve, each a folder at the top of the repository (and under pdserve/ once
# installed from a wheel).
PARTS = (
    "cluster",
    "engine",
    "kernels",
    "kv_transfer",
    "prefill_node",
    "decode_node",
    "coordinator",
    "tune",
    "bench",
    "deploy",
)

# The folder holding this package (a checkout, or site-packages): what a child process needs on its
# path to import pdserve.
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def cache_root() -> Path:
    """Where pdserve keeps what it builds or generates (the tiny model, compiled kernels, logs):
    $PDSERVE_CACHE, else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


# Run from a checkout (on PYTHONPATH, or installed editable), the parts lie beside this folder:
# pdserve.engine is <checkout>/engine.
if not (Path(__file__).parent / "engine").is_dir() and (SOURCE_ROOT / "engine").is_dir():
    __path__.append(str(SOURCE_ROOT))  # noqa: F821 (a package's __path__)
