"""What pdserve needs on a GPU host without a package registry: the packages such a host has
(deploy/gpu-host-packages.txt), the wheels pinned for the rest (deploy/gpu-wheels.txt), and the
checks that the two together cover every import and every declared requirement.

Stdlib only (plus `packaging`, which pip carries), so it runs before anything is installed.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip vendors it wherever pip is
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import (  # type: ignore[no-redef]
        InvalidRequirement,
        Requirement,
    )
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
PINS_FILE = REPO / "deploy" / "gpu-wheels.txt"
HOST_FILE = REPO / "deploy" / "gpu-host-packages.txt"

# The host's interpreter and the wheel tags it takes (the device README's list, newest first).
HOST_PYTHON = "3.12"
HOST_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# Requirement markers evaluated as on the host (CPython 3.12 on Linux x86-64, no extras).
HOST_MARKERS = {
    **default_environment(),
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "python_version": HOST_PYTHON,
    "python_full_version": HOST_PYTHON + ".3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

# First-party code whose imports must all be satisfied on the host: the packages pyproject
# installs, the benches, and the tests (gpu-check runs their GPU part there).
SCANNED = (
    "cluster",
    "coordinator",
    "decode_node",
    "engine",
    "kernels",
    "kv_transfer",
    "pdserve",
    "prefill_node",
    "tune",
    "bench",
    "deploy",
    "tests",
)
# Imported only by code gpu-check never runs on the host, and why.
NOT_NEEDED_ON_HOST = {
    "openai": "tests/test_http_api.py's OpenAI-client checks run in the CPU suite only",
    "anthropic": "tests/test_messages_api.py's Anthropic-client checks run in the CPU suite only",
    "schemathesis": "tests/test_http_security.py's schema fuzzing runs in the CPU suite only",
    "kubernetes_validate": "tests/test_deploy.py's manifest checks run in the CPU suite only",
    "jsonschema": "tests/test_structured_output.py's schema checks run in the CPU suite only",
    "grpc": "tests/otlp_receiver.py's gRPC collector serves tests/test_tracing.py, in the CPU suite only",
    "compressed_tensors": "tests/test_quant_compressed_tensors.py cross-checks the layout in the CPU suite only",
    "accelerate": "tests/test_quant_fp8.py and test_quant_mxfp4.py load quantized checkpoints in transformers in the CPU suite only",
    "vllm": "bench/peers/vllm_runner.py runs in vLLM's own CPU virtualenv (make bench-peers)",
    "protocol": "bench/peers/vllm_runner.py, run as a script there, imports its sibling by name",
}
# What the GPU tests and benches need beyond pyproject's runtime dependencies.
CHECK_NEEDS = (
    "pytest",
    "pytest-timeout",
    "transformers",
    "hypothesis",
    "httpx",
    "tqdm",
    "matplotlib",
    "triton",
    "cupy-cuda13x",
    "nvidia-nccl-cu13",
)
# What only a GPU host needs: a CPU machine may lack these without harm.
GPU_ONLY = ("triton", "cupy-cuda13x", "nvidia-nccl-cu13")
# Import names of distributions not imported by their own name.
IMPORT_NAMES = {
    "pyzmq": ("zmq",),
    "pytest": ("pytest", "_pytest"),
    "opentelemetry-api": ("opentelemetry",),
    "cupy-cuda13x": ("cupy", "cupyx", "cupy_backends"),
    "pyyaml": ("yaml",),
    "pillow": ("PIL",),
    "scikit-learn": ("sklearn",),
    "scikit-image": ("skimage",),
    "pytest-xdist": ("xdist",),
    "opencv-python-headless": ("cv2",),
    "protobuf": ("google",),
    "nvidia-nccl-cu13": ("nvidia",),
    "python-dateutil": ("dateutil",),
    "huggingface-hub": ("huggingface_hub",),
    "typing-extensions": ("typing_extensions",),
    "apache-tvm-ffi": ("tvm_ffi",),
    "rpds-py": ("rpds",),
    "attrs": ("attr", "attrs"),
}


@dataclass(frozen=True, slots=True)
class Pin:
    name: str  # canonical distribution name
    version: str
    why: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def import_names(dist: str) -> tuple[str, ...]:
    name = canonicalize_name(dist)
    return IMPORT_NAMES.get(name, (name.replace("-", "_"),))


def _lines(path: Path) -> Iterable[tuple[str, str]]:
    """(requirement, trailing comment) of each non-comment line."""
    for raw in path.read_text().splitlines():
        text, _, comment = raw.partition("#")
        if text.strip():
            yield text.strip(), comment.strip()


def read_pins(path: Path = PINS_FILE) -> list[Pin]:
    """The pinned wheels; a line that is not `name==version`, or a name twice, is an error."""
    pins: list[Pin] = []
    for text, why in _lines(path):
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", text)
        if match is None:
            raise ValueError(f"{path.name}: {text!r} is not name==version")
        pins.append(Pin(canonicalize_name(match[1]), match[2], why))
    names = [p.name for p in pins]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{path.name}: pinned more than once: {', '.join(twice)}")
    return pins


def read_host(path: Path = HOST_FILE) -> dict[str, str | None]:
    """The host's distributions: canonical name -> version, None where not known."""
    host: dict[str, str | None] = {}
    for text, _ in _lines(path):
        name, _, version = text.partition("==")
        host[canonicalize_name(name)] = version or None
    return host


# --- imports of the code itself -----------------------------------------------------------------


def first_party_names(repo: Path = REPO) -> set[str]:
    """Top-level packages of the repository, and the tests' own helper modules."""
    names = {p.name for p in repo.iterdir() if (p / "__init__.py").is_file()}
    return names | {p.stem for p in (repo / "tests").glob("*.py")}


def third_party_imports(repo: Path = REPO) -> dict[str, set[str]]:
    """Every top-level module the scanned code imports (anywhere, lazily too) that is neither
    stdlib nor first-party: name -> the files importing it."""
    ours = first_party_names(repo)
    found: dict[str, set[str]] = {}
    for folder in SCANNED:
        for path in sorted((repo / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        found.setdefault(top, set()).add(str(path.relative_to(repo)))
    return found


def uncovered_imports(provided: Mapping[str, str], repo: Path = REPO) -> dict[str, set[str]]:
    """Imports of the scanned code that nothing provides on the host: `provided` maps an import
    name to what provides it (a host package or a pinned wheel)."""
    return {
        name: files
        for name, files in third_party_imports(repo).items()
        if name not in provided and name not in NOT_NEEDED_ON_HOST
    }


def host_import_names(host: Mapping[str, str | None]) -> dict[str, str]:
    return {module: f"host: {dist}" for dist in host for module in import_names(dist)}


# --- declared requirements ----------------------------------------------------------------------


@dataclass(slots=True)
class RequirementCheck:
    """Requirements of a set of distributions against what is available where they will run."""

    missing: list[str] = field(default_factory=list)  # "who needs what": nothing provides it
    conflicts: list[str] = field(default_factory=list)  # provided, at a version outside the range
    unverified: list[str] = field(default_factory=list)  # provided, at a version not known

    @property
    def ok(self) -> bool:
        return not self.missing and not self.conflicts


def check_requirements(
    needs: Iterable[tuple[str, str]],
    available: Mapping[str, str | None],
    markers: Mapping[str, str] = HOST_MARKERS,
) -> RequirementCheck:
    """`needs`: (who, requirement string) pairs; `available`: canonical name -> version (None:
    present, version unknown). Markers are evaluated for `markers`, with no extras asked for."""
    result = RequirementCheck()
    for who, text in needs:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            result.missing.append(f"{who}: unparsable requirement {text!r}")
            continue
        if req.marker is not None and not req.marker.evaluate(dict(markers)):
            continue
        name = canonicalize_name(req.name)
        if name not in available:
            result.missing.append(f"{who} needs {text}")
            continue
        version = available[name]
        if not req.specifier:
            continue
        if version is None:
            result.unverified.append(f"{who} needs {text}: present, version unknown")
            continue
        try:
            ok = req.specifier.contains(Version(version), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            result.conflicts.append(f"{who} needs {text}: {name} {version} is there")
    return result


def installed(path: Path) -> dict[str, metadata.Distribution]:
    """Distributions installed in one directory (a `pip install --target` tree)."""
    return {
        canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(path)])
    }


def distribution_needs(dists: Mapping[str, metadata.Distribution]) -> list[tuple[str, str]]:
    return [
        (f"{name} {dist.version}", text)
        for name, dist in sorted(dists.items())
        for text in dist.requires or []
    ]


def project_needs(repo: Path = REPO) -> list[tuple[str, str]]:
    """pyproject's runtime dependencies and what gpu-check's tests and benches import."""
    text = (repo / "pyproject.toml").read_text()
    import tomllib

    deps = tomllib.loads(text)["project"]["dependencies"]
    return [("pdserve", d) for d in deps] + [("gpu-check", d) for d in CHECK_NEEDS]


def top_level_modules(dist: metadata.Distribution) -> set[str]:
    """Top-level import names a distribution installs, read from its RECORD."""
    names = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first.endswith((".dist-info", ".data", ".libs")) or first in ("..", "bin"):
            continue
        names.add(first.split(".")[0] if len(file.parts) == 1 else first)
    return {n for n in names if n.isidentifier()}
