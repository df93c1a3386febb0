"""`pdserve-bench`: a random-weight Llama-shaped checkpoint with pdserve-tiny's tokenizer, sized so
that on a CPU a 2k-token prefill costs ~50 decode steps (hundreds of milliseconds), well above
the scheduling noise of a shared machine. Generated deterministically into the model cache."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pdserve import cache_root
from pdserve.engine.embedded.tiny import TINY_CONFIG, ensure_tiny_model, write_checkpoint

BENCH_NAME = "pdserve-bench"
BENCH_VERSION = "1"
BENCH_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def ensure_bench_model() -> Path:
    """The checkpoint's directory, written on first use."""
    target = cache_root() / f"{BENCH_NAME}-v{BENCH_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    tiny = ensure_tiny_model()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{BENCH_NAME}-", dir=target.parent))
    try:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / name, tmp / name)
        vocab_size = json.loads((tiny / "config.json").read_text())["vocab_size"]
        write_checkpoint(tmp, {**TINY_CONFIG, **BENCH_SHAPE, "vocab_size": vocab_size}, seed=0)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
