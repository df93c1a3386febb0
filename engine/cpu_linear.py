"""Linear layers on CPU through oneDNN, each weight packed once after loading into oneDNN's
blocked layout (what vLLM's CPU backend does for its dense projections). `F.linear` on the plain
row-major weight re-lays the weight out for the matmul on every call; on a 2-core CPU the packed
path took the vocabulary projection of a 52M-parameter Llama at 1.7x the rate for 40 tokens.

Float32 only (oneDNN's bfloat16 path needs AVX-512 BF16 to pay), CPU only, and not with the
compiled step (inductor packs weights its own way). A packed layer drops its plain weight, unless
another layer shares it (a tied embedding keeps it for the lookup)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

logger = logging.getLogger(__name__)

# The batch size oneDNN lays the packed weight out for; any batch runs on it.
BATCH_HINT = 32


def packing_unavailable(device: str, dtype: str, compiled: bool) -> str | None:
    """Why the onednn backend cannot serve this node (one line), or None when it can."""
    if not device.startswith("cpu"):
        return "packed linear layers are for CPU nodes"
    if dtype != "float32":
        return f"packed linear layers are float32 only (this node runs {dtype})"
    if compiled:
        return "the compiled step packs its own weights"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    return None


def choose(setting: str, device: str, dtype: str, compiled: bool) -> bool:
    """Whether to pack: `onednn` where it can (else a log line says why not); `auto` as onednn,
    without the log line; `torch` never."""
    if setting == "torch":
        return False
    why = packing_unavailable(device, dtype, compiled)
    if why is not None and setting == "onednn":
        logger.warning("cpu_linear onednn: %s; linear layers run through F.linear", why)
    return why is None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that runs on its packed weight once `pack` has made one."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def pack(model: nn.Module) -> int:
    """Pack the weight of every layer of `model` that runs through `linear` (those with a
    `packed` attribute) and drop its plain weight, unless another layer shares it (a tied
    embedding); the number packed."""
    ours = [m for m in model.modules() if hasattr(m, "packed")]
    shared = {
        id(p)
        for m in model.modules()
        if not hasattr(m, "packed")
        for p in m.parameters(recurse=False)
    }
    for module in ours:
        weight = module.weight.detach()
        module.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        if id(module.weight) not in shared:
            empty = torch.empty(0, dtype=weight.dtype, device=weight.device)
            module.weight = nn.Parameter(empty, requires_grad=False)
    return len(ours)
