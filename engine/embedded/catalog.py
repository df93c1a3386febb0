"""The models pdserve carries, and what a missing model means: `pdserve-stories` (trained by
`python -m pdserve.bench.stories.train`, shipped in the repository; the default) and `pdserve-tiny`
(random weights, generated on first use; small and fast, for tests). `PDSERVE_MODEL` names the
model to use when none is given. Importing this module imports no torch."""

from __future__ import annotations

import os
from pathlib import Path

STORIES = "pdserve-stories"
TINY = "pdserve-tiny"
EMBEDDED = (STORIES, TINY)
STORIES_DIR = Path(__file__).parent / STORIES


def default_model() -> str:
    """The model used when none is given: $PDSERVE_MODEL, else pdserve-stories."""
    return os.environ.get("PDSERVE_MODEL") or STORIES


def model_name(model: str | None) -> str:
    """What a model is called: an embedded model's name, or a checkpoint directory's name."""
    model = model or default_model()
    return model if model in EMBEDDED else Path(model).expanduser().resolve().name


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory of a model: an embedded one by name, or the directory given."""
    model = model or default_model()
    if model == TINY:
        from pdserve.engine.embedded.tiny import ensure_tiny_model

        return ensure_tiny_model()
    if model == STORIES:
        if not (STORIES_DIR / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"{STORIES} is not in {STORIES_DIR}: train it with `python -m pdserve.bench.stories.train`"
            )
        return STORIES_DIR
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {model!r} does not exist (no model hub is used: give a local "
            f"Hugging Face-format directory, or one of the embedded models {', '.join(EMBEDDED)})"
        )
    return path
